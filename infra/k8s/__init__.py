"""Kubernetes manifests as plain data (dicts), plus the one module of labels, taints,
tolerations and namespaces that every manifest and component shares. No Pulumi import.
"""
