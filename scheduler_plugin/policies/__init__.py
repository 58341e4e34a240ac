"""Default control policies. Each is a small class; calling it with a ClusterView returns
actions. Configure, replace or add policies under ``agents.control.policies``."""
