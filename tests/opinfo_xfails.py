XFAIL: dict = {}
CRASHES: dict = {}
