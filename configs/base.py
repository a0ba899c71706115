# The base GPU run: 8 layers of width 512 (8 heads of dim 64) over 8192-byte contexts, bf16 autocast.
#   python train.py --seq-len 8192 --use-cuda-kernel          # cosine-sim on our kernels (this is the default config)
#   python train.py --attention softmax                       # the SDPA baseline
attention = "cosine"
n_layer = 8
n_head = 8
n_embd = 512
seq_len = 8192
dropout = 0.0
batch_size = 8
grad_accum_steps = 1
max_iters = 10000
warmup_iters = 500
lr = 1e-3
min_lr = 1e-4
weight_decay = 0.1
eval_interval = 500
eval_max_windows = 64
ckpt_interval = 1000
dtype = "auto"
