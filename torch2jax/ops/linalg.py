"""Lowerings: linalg ops."""

from __future__ import annotations

import torch

aten = torch.ops.aten
prims = torch.ops.prims
