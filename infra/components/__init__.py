"""Pulumi components: one ComponentResource per concern, each `Component(name, args, opts)`.

What flows through here: typed Args built by `__main__.py` from the validated stack config ->
AWS, EKS and Kubernetes resources, each child named `f"{name}-suffix"` with `parent=self`.
Nothing here reads Pulumi config or the file system except `llm_service` (the serving zip).
"""
