"""Serving on Ray: `build_app` (the Serve application), the engine and ingress deployments,
placement of TP groups, autoscaling, and `specserve serve`."""

from __future__ import annotations

from typing import Any


def build_app(args: Any = None):
    """`specserve.serve:build_app`, importable from Serve config files (see `specserve.serve.app`)."""
    from specserve.serve.app import build_app as build

    return build(args)
