"""The run spec of this host as `aihpc calibrate --local` writes it, shared by the tests of the
trainer's prediction for the machine at hand (test_train_resume.py, test_prediction_for.py)."""

# [cluster] as `aihpc calibrate --local --nproc N` wrote it on the 2-core CI host (``{n}``: ranks)
HOST_COPY = """
[model]
preset = "tiny-llama"
[cluster]
num_gpus = {n}
gpus_per_node = {n}
[cluster.gpu_spec]
name = "CPU x86_64 (1 threads) as {n} rank(s)"
bf16_tflops = 0.0951
fp32_tflops = 0.0951
hbm_gib = 11.8
hbm_bw_GBps = 19.6
scale_up_bw_GBps = 1.39
scale_up_domain = {n}
scale_out_bw_GBps = 1.39
gpus_per_node = {n}
gemm_efficiency = 1.0
attention_fwd_efficiency = 0.164
attention_bwd_efficiency = 0.188
attention_tokens = 64
host_is_device = true
"""
