"""Tensor parallelism: one engine instance over N ranks (one process each), gloo on CPU, NCCL on GPU.

split.py   which heads / rows each rank owns (no torch)
group.py   the process group of one instance (loopback rendezvous) and its collectives
layers.py  column/row-parallel linears, vocab-parallel embedding and LM head (plain modules at TP=1)
weights.py HF-named tensors sharded per rank (fused qkv/gate_up rows included), and back
plan.py    a step's plan as int64 tensors (rank 0 -> every rank; no pickle)
runner.py  rank 0's model runner: broadcasts each plan, assembles full-head pages
worker.py  ranks 1..N-1: the process main and its loop
launch.py  rank 0 starts the other ranks and watches them
rank_pages.py  pages rank to rank over shm / cuda-ipc (each rank writes its heads into the decode ranks holding them)
rank_regions.py  replicated page regions (index keys) rank to rank: each rank's page share into every decode rank
"""
