"""What both wings of the serving code share at run time: the failure taxonomy, handle-call helpers, Serve's view of running replicas."""
