"""On an NVIDIA GPU (`gpu`, `gpu_device.sh` on a lent machine): the CUDA tests, one
client stage by stage, BERT over HTTP, GPT-2 generation and CUDA graphs."""
