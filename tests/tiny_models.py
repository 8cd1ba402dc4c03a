"""Tiny Hugging Face models shared by tests outside the integration suite (export, ONNX)."""


def tiny_marian_config(transformers, **overrides):
    """A one-layer Marian of width 16 over 60 tokens (pad 1, eos 2), no dropout."""
    settings = dict(vocab_size=60, max_position_embeddings=64, scale_embedding=True, d_model=16, encoder_layers=1,
                    decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                    decoder_ffn_dim=32, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1,
                    bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, init_std=0.5)
    settings.update(overrides)
    return transformers.MarianConfig(**settings)
