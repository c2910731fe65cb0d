"""The local runners: one base (base.py: a slot's sequence, session reuse, the step's timing and
stats, the out-of-memory contract) and two back ends that keep only what is theirs —
llama_cpp.py (a GGUF file on llama.cpp) and transformers.py (a torch model) — with the sampler's
rules once in sampling.py. Must not import torch or llama_cpp here: backends.py picks one lazily.
"""
