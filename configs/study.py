# The long-context study's model (make compare): 6 layers of width 384, 6 heads of 64 (10.7M parameters).
# On the 4 MB enwik8 prefix it memorises the train split within ~13 epochs (val bpc turns up after ~1500
# steps of 32,768 tokens without dropout: bench/notes/run-34.md), hence dropout and the study's 1500 steps;
# the report shows the train/val gap. torch.compile roughly doubles this launch-bound size's tokens/s.
# compare.py sets the context, batch, steps, learning rate and seed of each run.
attention = "softmax"
n_layer = 6
n_head = 6
n_embd = 384
seq_len = 1024
dropout = 0.1
batch_size = 16
max_iters = 1000
warmup_iters = 100
lr = 2e-3
min_lr = 2e-4
weight_decay = 0.1
eval_interval = 250
eval_max_windows = 16
sample_tokens = 0
ckpt_interval = 250
dtype = "auto"
compile = True
