"""A local Kubernetes control plane whose node agent runs pods as local processes."""
