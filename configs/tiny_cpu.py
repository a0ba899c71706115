# A smoke run that trains on a laptop CPU in a few minutes and reaches val bpc < 3:
#   python train.py --config configs/tiny_cpu      (what `python train.py` takes on a machine without a GPU)
attention = "cosine"
n_layer = 4
n_head = 4
n_embd = 128
seq_len = 128
batch_size = 32
max_iters = 600
warmup_iters = 50
lr = 2e-3
min_lr = 2e-4
eval_interval = 200
eval_max_windows = 32
sample_tokens = 128
ckpt_interval = 200
