# Sourced: pretrain_gpt.py's flags for the tiny Llama-style GPT of the converter's real Megatron-LM
# checkpoints (2 layers, hidden 64, SwiGLU, GQA, RMSNorm, RoPE, untied, fp32, local spec, no fused
# kernels: no Transformer Engine or Apex on the GPU machine).
# shellcheck disable=SC2034  # used by the scripts that source this
model=(--num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4
       --group-query-attention --num-query-groups 2 --seq-length 32 --max-position-embeddings 32
       --swiglu --normalization RMSNorm --position-embedding-type rope --no-rope-fusion
       --untie-embeddings-and-output-weights --disable-bias-linear
       --tokenizer-type NullTokenizer --vocab-size 128 --transformer-impl local
       --no-persist-layer-norm --no-masked-softmax-fusion --no-bias-swiglu-fusion --no-bias-dropout-fusion)
