"""Sampling on the worker: each slot's sampling state on the device (SlotSampling), a step's
per-row policy (SamplingBatch), the Sampler, penalties and logit_bias, grammars and their masks,
and host-logits mode's logits on the wire."""
