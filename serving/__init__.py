"""The Ray Serve application that runs vLLM prefill/decode engines behind an OpenAI API."""
