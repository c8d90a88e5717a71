"""Tensor and expert parallelism for every family: per-rank configs and layers (dense.py: the Llama family;
mla.py: DeepSeek-V3 / V3.2; hybrid.py: Qwen3.5), how a stored tensor is cut (shard_cut.py), reading only a
rank's share (sharded_read.py), and experts split whole over ranks (experts.py, expert_weights.py)."""
