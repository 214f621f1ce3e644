"""The engine side: the servers that run vLLM (the resilient P/D decode server with its prefill hop and circuit, the eager-first-chunk server) and their autoscaling policies."""
