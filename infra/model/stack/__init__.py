"""The stack config's parts, one module per concern; `infra.model.config` composes them.

Each module holds the keys of one concern as a pydantic model (`*Keys`, the same flat keys a
stack file has), the nested models and enums of those keys, and the cross-field checks of the
concern as functions of the composed `StackConfig`. Other modules import from
`infra.model.config`, which re-exports every public name.
"""
