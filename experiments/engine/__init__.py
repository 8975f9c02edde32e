"""The model and the engine against transformers on the GPU: the vision tower and logits (`model`), a W3B
rollout and the decode batch sweep (`rollout`)."""
