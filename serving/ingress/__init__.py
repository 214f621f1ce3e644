"""The OpenAI front door: auth, request fields, the model, limits, routing (cluster or fallback), the resilient relay of the answer, SSE and stream migration."""
