"""posenc_fast.patch_model on tiny random Hugging Face models of every supported family.

Each family is one row of ``FAMILIES``: a builder of a tiny model from its config (no downloads) and
the kind of inputs it takes.  The patched model is compared with an unpatched deep copy: logits with
left and right padding, greedy ``generate()`` with the KV cache, Parameters and tying, gradients,
and ``state_dict`` / ``save_pretrained``.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Callable, Tuple

import pytest
import torch

transformers = pytest.importorskip("transformers")

import posenc_fast as pf  # noqa: E402
from posenc_fast.integrations import transformers as integration  # noqa: E402

VOCAB = 40
PAD = 1
EOS = 2
D = 16
# The fused PE is the float64 sinusoid rounded once; the models' own fp32 tables are off by ~1e-7 at
# the few positions used here.  Logits of the tiny models then agree to a few 1e-6 (measured ~5e-8
# to 3e-6); gradients (larger values) are compared relatively.
LOGITS_ATOL = 2e-5
GRAD_RTOL = 1e-4


def _small(**extra):
    return dict(d_model=D, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
                encoder_ffn_dim=32, decoder_ffn_dim=32, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                pad_token_id=PAD, bos_token_id=0, eos_token_id=EOS, decoder_start_token_id=EOS, init_std=0.5,
                **extra)


def m2m100(scale_embedding=True):
    config = transformers.M2M100Config(vocab_size=VOCAB, max_position_embeddings=64, scale_embedding=scale_embedding,
                                       **_small())
    return transformers.M2M100ForConditionalGeneration(config)


def nllb_moe():
    config = transformers.NllbMoeConfig(vocab_size=VOCAB, max_position_embeddings=64, num_experts=2,
                                        expert_capacity=8, encoder_sparse_step=1, decoder_sparse_step=1,
                                        moe_token_dropout=0.0, scale_embedding=True, **_small())
    return transformers.NllbMoeForConditionalGeneration(config)


def marian():
    config = transformers.MarianConfig(vocab_size=VOCAB, max_position_embeddings=64, scale_embedding=True, **_small())
    return transformers.MarianMTModel(config)


def marian_odd_width():
    extra = _small()
    extra.update(d_model=15, encoder_attention_heads=3, decoder_attention_heads=3)
    config = transformers.MarianConfig(vocab_size=VOCAB, max_position_embeddings=64, scale_embedding=False, **extra)
    return transformers.MarianMTModel(config)


def pegasus():
    config = transformers.PegasusConfig(vocab_size=VOCAB, max_position_embeddings=64, scale_embedding=True, **_small())
    return transformers.PegasusForConditionalGeneration(config)


def fsmt():
    extra = _small()
    del extra["init_std"]
    config = transformers.FSMTConfig(langs=["en", "de"], src_vocab_size=VOCAB, tgt_vocab_size=VOCAB + 3,
                                     max_position_embeddings=64, scale_embedding=True, init_std=0.5,
                                     tie_word_embeddings=False, **extra)
    return transformers.FSMTForConditionalGeneration(config)


def speech_to_text():
    config = transformers.Speech2TextConfig(vocab_size=VOCAB, max_source_positions=64, max_target_positions=64,
                                            conv_kernel_sizes=(5, 5), conv_channels=8, input_feat_per_channel=8,
                                            input_channels=1, scale_embedding=True, **_small())
    return transformers.Speech2TextForConditionalGeneration(config)


def whisper():
    extra = _small()
    extra.update(decoder_start_token_id=0)
    config = transformers.WhisperConfig(vocab_size=VOCAB, num_mel_bins=8, max_source_positions=8,
                                        max_target_positions=32, **extra)
    return transformers.WhisperForConditionalGeneration(config)


def xlm():
    config = transformers.XLMConfig(vocab_size=VOCAB, emb_dim=D, n_layers=1, n_heads=2, dropout=0.0,
                                    attention_dropout=0.0, sinusoidal_embeddings=True, causal=True, pad_index=PAD,
                                    pad_token_id=PAD, eos_index=EOS, eos_token_id=EOS, bos_index=0,
                                    max_position_embeddings=64, embed_init_std=0.5, use_lang_emb=False)
    return transformers.XLMWithLMHeadModel(config)


def distilbert():
    config = transformers.DistilBertConfig(vocab_size=VOCAB, dim=D, n_layers=1, n_heads=2, hidden_dim=32,
                                           dropout=0.0, attention_dropout=0.0, sinusoidal_pos_embds=True,
                                           max_position_embeddings=64, pad_token_id=PAD, initializer_range=0.5)
    return transformers.DistilBertForMaskedLM(config)


def musicgen():
    config = transformers.MusicgenDecoderConfig(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=1,
                                                num_attention_heads=2, ffn_dim=32, num_codebooks=2, dropout=0.0,
                                                attention_dropout=0.0, activation_dropout=0.0,
                                                max_position_embeddings=64, pad_token_id=VOCAB,
                                                bos_token_id=VOCAB, eos_token_id=None, decoder_start_token_id=VOCAB,
                                                initializer_factor=0.5, scale_embedding=True)
    return transformers.MusicgenForCausalLM(config)


def musicgen_text_to_audio():
    """MusicGen's generation model: T5 text encoder, EnCodec audio codec, the MusicGen decoder (patched)."""
    codes = 64  # EnCodec needs a power of 2
    text = transformers.T5Config(vocab_size=VOCAB, d_model=D, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
                                 decoder_start_token_id=0, pad_token_id=0, dropout_rate=0.0)
    audio = transformers.EncodecConfig(hidden_size=D, num_filters=4, num_residual_layers=1, upsampling_ratios=[2, 2],
                                       codebook_size=codes, codebook_dim=D, target_bandwidths=[1.5],
                                       sampling_rate=400, audio_channels=1, num_lstm_layers=1)
    decoder = transformers.MusicgenDecoderConfig(vocab_size=codes, hidden_size=D, num_hidden_layers=1,
                                                 num_attention_heads=2, ffn_dim=32, num_codebooks=2, dropout=0.0,
                                                 attention_dropout=0.0, activation_dropout=0.0, max_position_embeddings=64,
                                                 pad_token_id=codes, bos_token_id=codes, decoder_start_token_id=codes,
                                                 initializer_factor=0.5)
    config = transformers.MusicgenConfig(text_encoder=text.to_dict(), audio_encoder=audio.to_dict(),
                                         decoder=decoder.to_dict())
    return transformers.MusicgenForConditionalGeneration(config)


def kosmos2_text():
    from transformers.models.kosmos2 import modeling_kosmos2

    config = transformers.Kosmos2Config(
        text_config=dict(vocab_size=VOCAB, embed_dim=D, layers=1, attention_heads=2, ffn_dim=32, dropout=0.0,
                         attention_dropout=0.0, activation_dropout=0.0, max_position_embeddings=64,
                         pad_token_id=PAD, bos_token_id=0, eos_token_id=EOS, scale_embedding=True, init_std=0.5),
    ).text_config
    return modeling_kosmos2.Kosmos2TextForCausalLM(config)


def kosmos2():
    config = transformers.Kosmos2Config(
        text_config=dict(vocab_size=VOCAB, embed_dim=D, layers=1, attention_heads=2, ffn_dim=32, dropout=0.0,
                         attention_dropout=0.0, activation_dropout=0.0, max_position_embeddings=64,
                         pad_token_id=PAD, bos_token_id=0, eos_token_id=EOS, scale_embedding=True, init_std=0.5),
        vision_config=dict(hidden_size=D, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=16, patch_size=8, dropout=0.0, attention_dropout=0.0),
        latent_query_num=3)
    return transformers.Kosmos2ForConditionalGeneration(config)


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    build: Callable
    kind: str  # "seq2seq" | "speech" | "whisper" | "causal" | "mlm" | "musicgen"
    generates: bool = True
    trainable_pe: Tuple[str, ...] = ()  # PE tables HF keeps trainable: they get no gradient once patched


FAMILIES = [
    Family("m2m100", m2m100, "seq2seq"),
    Family("m2m100_unscaled", lambda: m2m100(scale_embedding=False), "seq2seq"),
    Family("nllb_moe", nllb_moe, "seq2seq"),
    Family("marian", marian, "seq2seq"),
    Family("marian_unscaled_odd_width", marian_odd_width, "seq2seq"),
    Family("pegasus", pegasus, "seq2seq"),
    Family("fsmt", fsmt, "seq2seq",
           trainable_pe=("model.encoder.embed_positions.weight", "model.decoder.embed_positions.weight")),
    Family("speech_to_text", speech_to_text, "speech"),
    Family("whisper", whisper, "whisper"),
    Family("xlm", xlm, "causal", trainable_pe=("transformer.position_embeddings.weight",)),
    Family("distilbert", distilbert, "mlm", generates=False,
           trainable_pe=("distilbert.embeddings.position_embeddings.weight",)),
    Family("musicgen", musicgen, "musicgen"),
    Family("musicgen_text_to_audio", musicgen_text_to_audio, "musicgen_text"),
    Family("kosmos2_text", kosmos2_text, "causal"),
    Family("kosmos2_image_rows", kosmos2, "kosmos2"),
]


def _padded_ids(generator, batch=3, length=7, low=3):
    """Row 0 left-padded, row 1 right-padded, row 2 full."""
    ids = torch.randint(low, VOCAB, (batch, length), generator=generator)
    ids[0, :2] = PAD
    ids[1, -3:] = PAD
    return ids, (ids != PAD).long()


def make_inputs(family: Family, model, generator) -> dict:
    if family.kind == "seq2seq":
        ids, mask = _padded_ids(generator)
        decoder = torch.randint(3, VOCAB, (3, 5), generator=generator)
        decoder[1, -2:] = PAD  # a finished row
        return dict(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder)
    if family.kind == "speech":
        features = torch.randn(3, 24, 8, generator=generator)
        mask = torch.ones(3, 24, dtype=torch.long)
        mask[1, -9:] = 0
        return dict(input_features=features, attention_mask=mask,
                    decoder_input_ids=torch.randint(3, VOCAB, (3, 5), generator=generator))
    if family.kind == "whisper":
        return dict(input_features=torch.randn(3, 8, 16, generator=generator),
                    decoder_input_ids=torch.randint(3, VOCAB, (3, 5), generator=generator))
    if family.kind in ("causal", "mlm"):
        ids, mask = _padded_ids(generator)
        return dict(input_ids=ids, attention_mask=mask)
    if family.kind == "musicgen":
        return dict(input_ids=torch.randint(0, VOCAB, (3 * 2, 6), generator=generator))
    if family.kind == "musicgen_text":  # text ids for the T5 encoder, 2 codebooks for the decoder
        ids, mask = _padded_ids(generator, length=5)
        return dict(input_ids=ids, attention_mask=mask,
                    decoder_input_ids=torch.randint(0, 64, (3 * 2, 4), generator=generator))
    if family.kind == "kosmos2":  # image vectors substituted into token rows 1..3
        ids, mask = _padded_ids(generator, length=9)
        ids[0, :2] = 4  # no left padding before the image rows (the model takes image rows at fixed places)
        mask = (ids != PAD).long()
        image_rows = torch.zeros_like(ids)
        image_rows[:, 1:4] = 1
        return dict(input_ids=ids, attention_mask=mask, image_embeds_position_mask=image_rows,
                    pixel_values=torch.randn(3, 3, 16, 16, generator=generator))
    raise AssertionError(family.kind)


def _loss(family: Family, model, inputs) -> torch.Tensor:
    logits = model(**inputs).logits
    target = torch.linspace(-1, 1, logits.numel(), dtype=logits.dtype).reshape(logits.shape)
    return (logits * target).sum()


def _pair(family: Family):
    torch.manual_seed(1234)
    model = family.build().eval()
    return model, copy.deepcopy(model)


@pytest.fixture(params=FAMILIES, ids=lambda f: f.name)
def family(request):
    return request.param


def test_patch_keeps_parameters_logits_gradients_and_state(family, seed, tmp_path):
    model, original = _pair(family)
    generator = torch.Generator().manual_seed(seed)
    inputs = make_inputs(family, model, generator)
    parameters = dict(model.named_parameters(remove_duplicate=False))
    input_weight = model.get_input_embeddings()
    input_weight = input_weight.weight if hasattr(input_weight, "weight") else None
    output = model.get_output_embeddings()
    tied = input_weight is not None and getattr(output, "weight", None) is input_weight
    state = {k: v.clone() for k, v in model.state_dict().items()}

    assert pf.patch_model(model) is model
    patched_sides = [m for m in model.modules() if getattr(m, "_posenc_fast", None) is not None]
    assert patched_sides, "nothing was patched"

    # Parameters: the same objects under the same names; the input table and its tie unchanged.
    after = dict(model.named_parameters(remove_duplicate=False))
    assert after.keys() == parameters.keys()
    assert all(after[k] is parameters[k] for k in parameters)
    embeddings = model.get_input_embeddings()
    if input_weight is not None:
        assert embeddings.weight is input_weight
    if tied:
        assert model.get_output_embeddings().weight is input_weight
    assert model.state_dict().keys() == state.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())

    # Logits, left and right padding in the batch.
    with torch.no_grad():
        expected = original(**inputs).logits
        actual = model(**inputs).logits
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, atol=LOGITS_ATOL, rtol=0)
    assert model.training is False

    # Gradients land on the same Parameters, with the same values (up to the PE's rounding).
    model.train()
    original.train()
    _loss(family, model, inputs).backward()
    _loss(family, original, inputs).backward()
    original_parameters = dict(original.named_parameters())
    # Some gradients are zero up to rounding (a key bias under softmax): compare against the largest.
    largest = max(float(p.grad.abs().max()) for p in original_parameters.values() if p.grad is not None)
    for name, parameter in model.named_parameters():
        reference_grad = original_parameters[name].grad
        if name in family.trainable_pe:
            assert reference_grad is not None and parameter.grad is None  # documented: no longer used
            continue
        assert (parameter.grad is None) == (reference_grad is None), name
        if reference_grad is not None:
            torch.testing.assert_close(parameter.grad, reference_grad, atol=GRAD_RTOL * largest, rtol=GRAD_RTOL,
                                       msg=lambda m: f"{name}: {m}")

    # save_pretrained writes what the unpatched model holds, and it loads back into an unpatched model.
    model.save_pretrained(tmp_path)
    reloaded = type(model).from_pretrained(tmp_path)
    assert getattr(reloaded, "_posenc_fast", None) is None
    assert all(getattr(m, "_posenc_fast", None) is None for m in reloaded.modules())
    reloaded_state = reloaded.state_dict()
    for key, value in model.state_dict().items():
        torch.testing.assert_close(reloaded_state[key], value, atol=0, rtol=0, msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("family", [f for f in FAMILIES if f.generates], ids=lambda f: f.name)
def test_generate_greedy_identical_with_cache(family, seed):
    model, original = _pair(family)
    inputs = make_inputs(family, model, torch.Generator().manual_seed(seed))
    inputs.pop("decoder_input_ids", None)
    settings = dict(max_new_tokens=8, do_sample=False, use_cache=True)
    if family.kind == "musicgen":
        inputs["input_ids"] = inputs["input_ids"][:, :1] * 0 + model.config.bos_token_id
        settings.update(pad_token_id=model.config.pad_token_id, num_return_sequences=1)
    if family.kind == "musicgen_text":
        settings.update(guidance_scale=None)  # returns the decoded audio: equal codes give equal audio
    expected = original.generate(**inputs, **settings)
    # An end-of-sequence token that one row produces early, so that later steps decode finished
    # (padding) rows at a past length > 0 (where FSMT's position rule differs from fairseq's).
    if not family.kind.startswith("musicgen") and expected.shape[1] > 4:
        eos = int(expected[0, -4])
        settings.update(eos_token_id=eos, pad_token_id=PAD)
        expected = original.generate(**inputs, **settings)
    pf.patch_model(model)
    actual = model.generate(**inputs, **settings)
    assert torch.equal(actual, expected)


def test_patch_twice_changes_nothing_more():
    model, original = _pair(FAMILIES[0])
    pf.patch_model(model)
    forwards = {name: m.__dict__.get("forward") for name, m in model.named_modules()}
    pf.patch_model(model)
    assert forwards == {name: m.__dict__.get("forward") for name, m in model.named_modules()}
    ids = torch.randint(3, VOCAB, (2, 6))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, decoder_input_ids=ids).logits,
                                   original(input_ids=ids, decoder_input_ids=ids).logits, atol=LOGITS_ATOL, rtol=0)


@pytest.mark.parametrize("version", ["5.24.0", "6.0.0", "5.0.0", "4.57.6", "5.24.0.dev0"])
def test_unverified_transformers_release_leaves_the_model_unpatched(monkeypatch, version, seed):
    """A transformers release outside VERIFIED_TRANSFORMERS (5.24 changed how the cache reaches the
    decoders) gets a warning naming the version and an unpatched model: never different numbers."""
    model, original = _pair(FAMILIES[0])
    monkeypatch.setattr(integration, "_installed_transformers_version", lambda: version)
    forwards = {name: m.__dict__.get("forward") for name, m in model.named_modules()}
    with pytest.warns(RuntimeWarning, match=f"transformers {version} is outside"):
        assert pf.patch_model(model) is model
    assert forwards == {name: m.__dict__.get("forward") for name, m in model.named_modules()}
    assert all(getattr(m, "_posenc_fast", None) is None for m in model.modules())
    ids = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, decoder_input_ids=ids).logits,
                                   original(input_ids=ids, decoder_input_ids=ids).logits, atol=0, rtol=0)


def test_installed_transformers_is_a_verified_release():
    """The test extra resolves a release inside the verified range; this fails if it ever resolves one
    the patch was not verified against (the rest of this file would then test an unpatched model)."""
    assert integration._unverified_transformers() is None, transformers.__version__


def test_unsupported_model_raises_and_changes_nothing():
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32)
    model = transformers.BertModel(config)
    before = {name: dict(m.__dict__) for name, m in model.named_modules()}
    with pytest.raises(TypeError, match="BertModel"):
        pf.patch_model(model)
    assert {name: dict(m.__dict__) for name, m in model.named_modules()} == before


def test_trained_pe_table_is_refused_and_nothing_changes():
    model = distilbert()
    with torch.no_grad():
        model.distilbert.embeddings.position_embeddings.weight[3, 0] += 0.1  # as if fine-tuned
    with pytest.raises(ValueError, match="not the 'xlm' sinusoid"):
        pf.patch_model(model)
    assert all(getattr(m, "_posenc_fast", None) is None for m in model.modules())
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_learned_position_embeddings_are_refused():
    config = transformers.DistilBertConfig(vocab_size=VOCAB, dim=D, n_layers=1, n_heads=2, hidden_dim=32,
                                           sinusoidal_pos_embds=False)
    with pytest.raises(ValueError, match="learned position embeddings"):
        pf.patch_model(transformers.DistilBertModel(config))


EMBEDS_FAMILIES = ["m2m100", "nllb_moe", "marian", "pegasus", "xlm", "distilbert", "kosmos2_text", "musicgen"]


@pytest.mark.parametrize("family", [f for f in FAMILIES if f.name in EMBEDS_FAMILIES], ids=lambda f: f.name)
def test_user_inputs_embeds_get_the_pe_as_in_the_model(family, seed):
    """inputs_embeds instead of ids: the fused add numbers (and scales) them as the model does."""
    model, original = _pair(family)
    generator = torch.Generator().manual_seed(seed)
    inputs = dict(inputs_embeds=torch.randn(2, 6, D, generator=generator))
    if family.kind == "seq2seq":
        inputs["decoder_inputs_embeds"] = torch.randn(2, 4, D, generator=generator)
    pf.patch_model(model)
    with torch.no_grad():
        expected = original(**inputs).logits
        actual = model(**inputs).logits
    torch.testing.assert_close(actual, expected, atol=LOGITS_ATOL, rtol=0)


def test_fsmt_inputs_embeds_is_refused_clearly():
    """FSMT's own inputs_embeds path cannot number positions (it indexes its table with floats)."""
    model = pf.patch_model(fsmt())
    with pytest.raises(ValueError, match="takes input_ids, not inputs_embeds"):
        model(inputs_embeds=torch.randn(2, 5, D), decoder_input_ids=torch.randint(3, VOCAB, (2, 3)))


def test_families_cover_the_registry():
    """Every registered side class is exercised by a row of FAMILIES."""
    seen = set()
    for family in FAMILIES:
        model = family.build()
        seen |= {type(m).__name__ for m in model.modules() if integration._family_of(m) is not None}
    assert set(integration.supported_classes()) <= seen


@pytest.mark.parametrize("family", [f for f in FAMILIES if f.kind == "seq2seq"], ids=lambda f: f.name)
def test_cached_step_with_a_padding_token(family, seed):
    """A finished row feeds padding at past length > 0 (generate's finished rows): FSMT gives it position
    padding_idx + past and a PE, fairseq-style models keep it at the padding position."""
    model, original = _pair(family)
    inputs = make_inputs(family, model, torch.Generator().manual_seed(seed))
    decoder = inputs.pop("decoder_input_ids")
    pf.patch_model(model)
    step = torch.randint(3, VOCAB, (3, 1), generator=torch.Generator().manual_seed(seed + 1))
    step[1, 0] = PAD
    logits = []
    for m in (model, original):
        with torch.no_grad():
            first = m(**inputs, decoder_input_ids=decoder, use_cache=True)
            logits.append(m(**inputs, decoder_input_ids=step, past_key_values=first.past_key_values,
                            use_cache=True).logits)
    torch.testing.assert_close(logits[0], logits[1], atol=LOGITS_ATOL, rtol=0)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f.kind in ("speech", "whisper")], ids=lambda f: f.name)
def test_speech_encoder_outputs_hidden_states_and_attentions(family, seed):
    """The replaced speech-encoder forward keeps the model's output capture (hidden states, attentions)."""
    model, original = _pair(family)
    inputs = make_inputs(family, model, torch.Generator().manual_seed(seed))
    inputs.pop("decoder_input_ids")
    pf.patch_model(model)
    with torch.no_grad():
        expected = original.get_encoder()(**inputs, output_hidden_states=True, output_attentions=True)
        actual = model.get_encoder()(**inputs, output_hidden_states=True, output_attentions=True)
    assert len(actual.hidden_states) == len(expected.hidden_states) == model.config.encoder_layers + 1
    assert len(actual.attentions) == len(expected.attentions)
    for got, want in zip(actual.hidden_states + actual.attentions, expected.hidden_states + expected.attentions):
        torch.testing.assert_close(got, want, atol=LOGITS_ATOL, rtol=0)


def test_patched_model_compiles_fullgraph():
    """The patched forward (argument binding, fused op) traces without graph breaks."""
    model, original = _pair(FAMILIES[3])  # marian
    pf.patch_model(model)
    ids = torch.randint(3, VOCAB, (2, 7))
    decoder = torch.randint(3, VOCAB, (2, 5))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(input_ids=ids, decoder_input_ids=decoder).logits,
                                   original(input_ids=ids, decoder_input_ids=decoder).logits, atol=LOGITS_ATOL, rtol=0)


def test_deepcopy_and_pickle_keep_a_working_patch(tmp_path):
    """A deep copy or a pickled (torch.save) patched model runs its own modules, still patched."""
    model, original = _pair(FAMILIES[0])  # m2m100
    pf.patch_model(model)
    ids = torch.randint(3, VOCAB, (2, 6))
    expected = original(input_ids=ids, decoder_input_ids=ids).logits.detach()
    torch.save(model, tmp_path / "model.pt")
    for twin in (copy.deepcopy(model), torch.load(tmp_path / "model.pt", weights_only=False)):
        sides = [m for m in twin.modules() if getattr(m, "_posenc_fast", None) is not None]
        assert len(sides) == 2 and all(m.forward.args[0] is m for m in sides)
        with torch.no_grad():
            torch.testing.assert_close(twin(input_ids=ids, decoder_input_ids=ids).logits, expected,
                                       atol=LOGITS_ATOL, rtol=0)
