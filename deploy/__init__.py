"""Kubernetes deployment: image recipe, kustomize base, components and overlays (docs/kubernetes.md)."""
