# configs/base at 4x the context: 32768-byte windows, 2 per step so a step still holds 65,536 tokens.
#   python train.py --config configs/long --use-cuda-kernel
# The bpc-by-position curve of its evaluations shows what the extra context buys.
attention = "cosine"
n_layer = 8
n_head = 8
n_embd = 512
seq_len = 32768
dropout = 0.0
batch_size = 2
grad_accum_steps = 1
max_iters = 10000
warmup_iters = 500
lr = 1e-3
min_lr = 1e-4
weight_decay = 0.1
eval_interval = 500
eval_max_windows = 16
ckpt_interval = 1000
dtype = "auto"
