XFAIL: dict = {}
