"""Offline tools (render, plan, diff, newstack, affected, the mock runtime). The Pulumi
program never imports this package; `tools.affected` ignores changes under it.
"""
