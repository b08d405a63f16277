"""The bridge between training and rollout: the SGLang protocol subset, the async rollout client,
the embedded JAX server's HTTP front, and the weight streamer. Knows nothing of the trainer or
controller."""
