"""The capacity plan of a validated stack (make plan, make render): per role and per model, GPUs, prices, scaling ranges, the head, as figures and as text."""
