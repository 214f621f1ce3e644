"""Pulumi components for disaggregated LLM inference on EKS (see README)."""
