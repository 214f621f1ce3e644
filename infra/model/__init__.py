"""Pure model code: the stack config, the instance catalog, pinned versions, sizing and the
capacity plan. No Pulumi import and no I/O, so tools, tests and the policy pack can use it.
"""
