"""posenc_fast.patch_model on tiny random Hugging Face models of every supported family.

Each family is one row of ``FAMILIES``: a builder of a tiny model from its config (no downloads) and
the kind of inputs it takes.  The patched model is compared with an unpatched deep copy wherever users
reach it: logits with left and right padding, greedy and beam ``generate()`` with and without the KV
cache, Parameters, tying and gradients, ``state_dict`` / ``save_pretrained``, hooks on the input
embeddings (NEFTune, PEFT's input-grad hook), gradient checkpointing, replaced, rescaled and resized
embeddings, ``inputs_embeds``, ``torch.compile(fullgraph=True)``, DDP, position tables made trainable again
after patching (gradients, an optimizer step), models built under ``torch.device("meta")`` (patched inside
or after it) or under another default device, loads that leave the position tables wrong (meta,
``device_map``), and deployment: transformers' own exporters (torch.export, ONNX) and optimum-onnx.  Where
the unpatched model itself raises (a transformers release's own bug), the patched one must raise the same.
.ci/run runs this file on the oldest supported transformers and on the newest.
"""

from __future__ import annotations

import copy
import functools
import inspect
import dataclasses
import warnings
from typing import Callable, FrozenSet, List, Tuple

import pytest
import torch

transformers = pytest.importorskip("transformers")

import posenc_fast as pf  # noqa: E402
from posenc_fast import _dispatch, _prepared  # noqa: E402
from posenc_fast.integrations import transformers as integration  # noqa: E402

VOCAB = 40
PAD = 1
EOS = 2
D = 16
INIT_STD = 0.5  # the tiny models' weight and embedding std, whatever each config calls it
# The patched PE is the float64 sinusoid rounded once; the models' own fp32 tables are off by ~1e-7 at
# the few positions used here.  The tiny models amplify that into the logits by a factor that depends on
# the draw: over 5,000 seeds per family (transformers 4.57.6 and 5.24.0) the inputs_embeds test's largest
# difference was 3% of this bound at the median and 47% at the worst (FSMT).  Gradients (larger values)
# are compared relatively.
LOGITS_ATOL = 2e-5
GRAD_RTOL = 1e-4


def _small(**extra):
    return dict(d_model=D, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
                encoder_ffn_dim=32, decoder_ffn_dim=32, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                encoder_layerdrop=0.0, decoder_layerdrop=0.0,  # (M2M100's default 0.05 makes training steps random)
                pad_token_id=PAD, bos_token_id=0, eos_token_id=EOS, decoder_start_token_id=EOS, init_std=INIT_STD,
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
                                     max_position_embeddings=64, scale_embedding=True, init_std=INIT_STD,
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
                                    max_position_embeddings=64, embed_init_std=INIT_STD, use_lang_emb=False)
    return transformers.XLMWithLMHeadModel(config)


def distilbert():
    config = transformers.DistilBertConfig(vocab_size=VOCAB, dim=D, n_layers=1, n_heads=2, hidden_dim=32,
                                           dropout=0.0, attention_dropout=0.0, sinusoidal_pos_embds=True,
                                           max_position_embeddings=64, pad_token_id=PAD, initializer_range=INIT_STD)
    return transformers.DistilBertForMaskedLM(config)


def whisper_audio_classification():
    """Whisper's encoder alone, under a classification head (its table: a frozen nn.Embedding)."""
    extra = _small()
    extra.update(decoder_start_token_id=0)
    config = transformers.WhisperConfig(vocab_size=VOCAB, num_mel_bins=8, max_source_positions=8,
                                        max_target_positions=32, num_labels=3, **extra)
    return transformers.WhisperForAudioClassification(config)


def musicgen():
    config = transformers.MusicgenDecoderConfig(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=1,
                                                num_attention_heads=2, ffn_dim=32, num_codebooks=2, dropout=0.0,
                                                attention_dropout=0.0, activation_dropout=0.0,
                                                max_position_embeddings=64, pad_token_id=VOCAB,
                                                bos_token_id=VOCAB, eos_token_id=None, decoder_start_token_id=VOCAB,
                                                initializer_factor=INIT_STD, scale_embedding=True)
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
                                                 initializer_factor=INIT_STD)
    config = transformers.MusicgenConfig(text_encoder=text.to_dict(), audio_encoder=audio.to_dict(),
                                         decoder=decoder.to_dict())
    return transformers.MusicgenForConditionalGeneration(config)


def kosmos2_text():
    from transformers.models.kosmos2 import modeling_kosmos2

    config = transformers.Kosmos2Config(
        text_config=dict(vocab_size=VOCAB, embed_dim=D, layers=1, attention_heads=2, ffn_dim=32, dropout=0.0,
                         attention_dropout=0.0, activation_dropout=0.0, max_position_embeddings=64,
                         pad_token_id=PAD, bos_token_id=0, eos_token_id=EOS, scale_embedding=True, init_std=INIT_STD),
    ).text_config
    return modeling_kosmos2.Kosmos2TextForCausalLM(config)


def kosmos2():
    config = transformers.Kosmos2Config(
        text_config=dict(vocab_size=VOCAB, embed_dim=D, layers=1, attention_heads=2, ffn_dim=32, dropout=0.0,
                         attention_dropout=0.0, activation_dropout=0.0, max_position_embeddings=64,
                         pad_token_id=PAD, bos_token_id=0, eos_token_id=EOS, scale_embedding=True, init_std=INIT_STD),
        vision_config=dict(hidden_size=D, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=16, patch_size=8, dropout=0.0, attention_dropout=0.0),
        latent_query_num=3)
    return transformers.Kosmos2ForConditionalGeneration(config)


def xglm():
    config = transformers.XGLMConfig(vocab_size=VOCAB, d_model=D, num_layers=1, attention_heads=2, ffn_dim=32,
                                     dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, layerdrop=0.0,
                                     max_position_embeddings=64, pad_token_id=PAD, bos_token_id=0, eos_token_id=EOS,
                                     scale_embedding=True, init_std=INIT_STD)
    return transformers.XGLMForCausalLM(config)


def pegasus_x():
    config = transformers.PegasusXConfig(vocab_size=VOCAB, max_position_embeddings=64, scale_embedding=True,
                                         block_size=4, num_global_tokens=2, **_small())
    return transformers.PegasusXForConditionalGeneration(config)


def _seamless(config_class, model_class):
    config = config_class(vocab_size=VOCAB, t2u_vocab_size=VOCAB, hidden_size=D, encoder_layers=1, decoder_layers=1,
                          encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
                          dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, max_position_embeddings=64,
                          encoder_layerdrop=0.0, decoder_layerdrop=0.0,
                          pad_token_id=PAD, bos_token_id=0, eos_token_id=EOS, decoder_start_token_id=EOS,
                          scale_embedding=True, initializer_range=INIT_STD)
    return model_class(config)


def seamless_m4t():
    return _seamless(transformers.SeamlessM4TConfig, transformers.SeamlessM4TForTextToText)


def seamless_m4t_v2():
    return _seamless(transformers.SeamlessM4Tv2Config, transformers.SeamlessM4Tv2ForTextToText)


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    build: Callable
    kind: str  # "seq2seq" | "speech" | "whisper" | "audio_classification" | "causal" | "mlm" | "musicgen" | ...
    generates: bool = True
    trainable_pe: Tuple[str, ...] = ()  # PE tables transformers 5.x keeps trainable: frozen once patched
    tokens: bool = True  # has a token table (get_input_embeddings() is an nn.Embedding)
    # The costly tests that run on this family besides those every family runs, each on a few families that
    # cover the position rules (Pegasus shares Marian's patch, Speech2Text M2M100's): "compile" (fullgraph),
    # "device_map", "offload" (accelerate's hooks), "static_cache" (compiled generation), "optimum",
    # "exporters" (transformers.exporters), "exporters_static" and "exporters_onnx" (their slow cases).
    costly: FrozenSet[str] = frozenset()


def families_for(test: str) -> List["Family"]:
    """The families whose ``costly`` names ``test``."""
    return [f for f in FAMILIES if test in f.costly]


def family_named(name: str) -> "Family":
    return next(f for f in FAMILIES if f.name == name)


FAMILIES = [
    Family("m2m100", m2m100, "seq2seq", costly=frozenset(
        {"compile", "device_map", "offload", "static_cache", "optimum", "exporters"})),
    Family("m2m100_unscaled", lambda: m2m100(scale_embedding=False), "seq2seq"),
    Family("nllb_moe", nllb_moe, "seq2seq"),
    Family("marian", marian, "seq2seq", costly=frozenset(
        {"compile", "device_map", "offload", "static_cache", "optimum", "exporters", "exporters_static"})),
    Family("marian_unscaled_odd_width", marian_odd_width, "seq2seq"),
    Family("pegasus", pegasus, "seq2seq", costly=frozenset({"static_cache", "optimum"})),
    Family("fsmt", fsmt, "seq2seq",
           trainable_pe=("model.encoder.embed_positions.weight", "model.decoder.embed_positions.weight"),
           costly=frozenset({"compile", "device_map", "exporters"})),
    Family("speech_to_text", speech_to_text, "speech"),
    Family("whisper", whisper, "whisper", costly=frozenset({"exporters", "exporters_static"})),
    Family("whisper_audio_classification", whisper_audio_classification, "audio_classification", generates=False,
           tokens=False),
    Family("xlm", xlm, "causal", trainable_pe=("transformer.position_embeddings.weight",),
           costly=frozenset({"compile", "device_map", "offload", "exporters"})),
    Family("distilbert", distilbert, "mlm", generates=False,
           trainable_pe=("distilbert.embeddings.position_embeddings.weight",),
           costly=frozenset({"compile", "exporters", "exporters_onnx"})),
    Family("musicgen", musicgen, "musicgen", tokens=False),
    Family("musicgen_text_to_audio", musicgen_text_to_audio, "musicgen_text", tokens=False),
    Family("kosmos2_text", kosmos2_text, "causal"),
    Family("kosmos2_image_rows", kosmos2, "kosmos2"),
    Family("xglm", xglm, "causal", costly=frozenset({"exporters", "exporters_onnx"})),
    Family("pegasus_x", pegasus_x, "seq2seq"),
    Family("seamless_m4t", seamless_m4t, "seq2seq"),
    Family("seamless_m4t_v2", seamless_m4t_v2, "seq2seq"),
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
    if family.kind == "audio_classification":
        return dict(input_features=torch.randn(3, 8, 16, generator=generator))
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


def _loss(model, inputs) -> torch.Tensor:
    logits = model(**inputs).logits
    target = torch.linspace(-1, 1, logits.numel(), dtype=logits.dtype).reshape(logits.shape)
    return (logits * target).sum()


def _pair(family: Family):
    torch.manual_seed(1234)
    model = family.build().eval()
    return model, copy.deepcopy(model)


def _patched_pair(family: Family, seed: int):
    """A patched model, its unpatched twin, and fresh inputs for both."""
    model, original = _pair(family)
    pf.patch_model(model)
    return model, original, make_inputs(family, model, torch.Generator().manual_seed(seed))


def _outcome(call):
    """(True, result) or (False, the exception's type): a transformers release whose own code raises on a
    path must raise the same there patched."""
    try:
        return True, call()
    except Exception as error:  # noqa: BLE001 - compared, not swallowed
        return False, type(error)


def _assert_same(patched_call, unpatched_call, compare):
    expected, got = _outcome(unpatched_call), _outcome(patched_call)
    assert expected[0] == got[0], (expected, got)
    if expected[0]:
        compare(got[1], expected[1])
    else:
        assert got[1] is expected[1]
    return expected[0]


def _close(got, expected):
    if expected is None:  # (attention weights that an attention implementation does not return)
        assert got is None
        return
    # Relative to the largest logit: a larger embed scale (or a hook's noise) amplifies the PE's rounding.
    scale = max(1.0, float(expected.abs().max())) if expected.numel() else 1.0
    torch.testing.assert_close(got, expected, atol=LOGITS_ATOL * scale, rtol=0)


def _logits(model, inputs):
    with torch.no_grad():
        return model(**inputs).logits


def _skip_where_the_model_itself_fails(model, inputs):
    # On a copy: a forward can change a model's Python-side state (NLLB-MoE's later training steps differ
    # after one eval call), and the models compared must have run the same calls.
    ok, error = _outcome(lambda: _logits(copy.deepcopy(model), inputs))
    if not ok:
        pytest.skip(f"the unpatched {type(model).__name__} raises {error.__name__} on transformers "
                    f"{transformers.__version__}")


def _patched_modules(model):
    return [m for m in model.modules() if getattr(m, "_posenc_fast", None) is not None]


def _gradients(model, parameters=None):
    return {name: p.grad for name, p in model.named_parameters() if parameters is None or name in parameters}


def _assert_same_gradients(model, original, skip=()):
    original_parameters = dict(original.named_parameters())
    # Some gradients are zero up to rounding (a key bias under softmax): compare against the largest.
    largest = max(float(p.grad.abs().max()) for p in original_parameters.values() if p.grad is not None)
    for name, parameter in model.named_parameters():
        if name in skip:
            continue
        reference_grad = original_parameters[name].grad
        assert (parameter.grad is None) == (reference_grad is None), name
        if reference_grad is not None:
            torch.testing.assert_close(parameter.grad, reference_grad, atol=GRAD_RTOL * largest, rtol=GRAD_RTOL,
                                       msg=lambda m: f"{name}: {m}")


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
    signatures = {name: inspect.signature(m.forward) for name, m in model.named_modules()}
    # (transformers 4.x has them frozen already: nothing to freeze, nothing to say)
    trainable_before = [name for name in family.trainable_pe if parameters[name].requires_grad]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert pf.patch_model(model) is model
    patched = _patched_modules(model)
    assert patched, "nothing was patched"
    # One warning naming every table it froze (and pointing here), none where nothing was frozen.
    froze = [w for w in caught if "patch_model froze" in str(w.message)]
    if trainable_before:
        assert len(froze) == 1 and froze[0].category is UserWarning and froze[0].filename == __file__, froze
        assert all(name in str(froze[0].message) for name in trainable_before), froze[0].message
        assert "requires_grad_(True)" in str(froze[0].message)
    else:
        assert not froze, [str(w.message) for w in froze]

    # Only the position modules' forwards are replaced; every other forward (and its signature, which
    # transformers' generation reads) is the model's own.
    for name, module in model.named_modules():
        if module in patched:
            continue
        assert "forward" not in module.__dict__, name
        assert inspect.signature(module.forward) == signatures[name], name

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
    for name in family.trainable_pe:  # frozen: nothing reads them once patched (README)
        assert after[name].requires_grad is False, name

    # Logits, left and right padding in the batch.
    if not _assert_same(lambda: _logits(model, inputs), lambda: _logits(original, inputs), _close):
        return
    assert model.training is False

    # Gradients land on the same Parameters, with the same values (up to the PE's rounding).
    model.train()
    original.train()
    _loss(model, inputs).backward()
    _loss(original, inputs).backward()
    for name in family.trainable_pe:
        assert after[name].grad is None
    _assert_same_gradients(model, original, skip=family.trainable_pe)

    # save_pretrained writes what the unpatched model holds, and it loads back into an unpatched model.
    model.save_pretrained(tmp_path)
    reloaded = type(model).from_pretrained(tmp_path)
    assert not _patched_modules(reloaded)
    reloaded_state = reloaded.state_dict()
    for key, value in model.state_dict().items():
        torch.testing.assert_close(reloaded_state[key], value, atol=0, rtol=0, msg=lambda m: f"{key}: {m}")


GENERATION_SETTINGS = {
    "greedy_cache": dict(do_sample=False, use_cache=True),
    "greedy_no_cache": dict(do_sample=False, use_cache=False),
    "beam_cache": dict(do_sample=False, num_beams=2, use_cache=True),
    "beam_no_cache": dict(do_sample=False, num_beams=2, use_cache=False),
}


@pytest.mark.parametrize("how", list(GENERATION_SETTINGS))
@pytest.mark.parametrize("family", [f for f in FAMILIES if f.generates], ids=lambda f: f.name)
def test_generate_gives_the_same_tokens(family, how, seed):
    model, original = _pair(family)
    inputs = make_inputs(family, model, torch.Generator().manual_seed(seed))
    inputs.pop("decoder_input_ids", None)
    settings = dict(max_new_tokens=8, **GENERATION_SETTINGS[how])
    if family.kind == "musicgen":
        inputs["input_ids"] = inputs["input_ids"][:, :1] * 0 + model.config.bos_token_id
        settings.update(pad_token_id=model.config.pad_token_id, num_return_sequences=1)
    if family.kind == "musicgen_text":
        settings.update(guidance_scale=None)  # returns the decoded audio: equal codes give equal audio
    ok, expected = _outcome(lambda: original.generate(**inputs, **settings))
    # An end-of-sequence token that one row produces early, so that later steps decode finished
    # (padding) rows at a past length > 0 (where FSMT's position rule differs from fairseq's).
    if ok and not family.kind.startswith("musicgen") and expected.shape[1] > 4:
        settings.update(eos_token_id=int(expected[0, -4]), pad_token_id=PAD)
    pf.patch_model(model)
    _assert_same(lambda: model.generate(**inputs, **settings), lambda: original.generate(**inputs, **settings),
                 lambda got, want: torch.testing.assert_close(got, want, atol=0, rtol=0))


@pytest.mark.parametrize("family", [f for f in FAMILIES if f.generates], ids=lambda f: f.name)
def test_decoding_steps_take_the_prepared_launch(family, seed, monkeypatch):
    """The patched position modules' repeated eager calls (the decoding steps) run the prepared launch kept for
    their spec where the backend has one, and generate what the general path generates, bit for bit."""
    from cases import PREPARED_BACKENDS

    model, _ = _pair(family)
    pf.patch_model(model)
    inputs = make_inputs(family, model, torch.Generator().manual_seed(seed))
    inputs.pop("decoder_input_ids", None)
    settings = dict(max_new_tokens=4, do_sample=False, use_cache=True)
    if family.kind == "musicgen":
        inputs["input_ids"] = inputs["input_ids"][:, :1] * 0 + model.config.bos_token_id
        settings.update(pad_token_id=model.config.pad_token_id, num_return_sequences=1)
    if family.kind == "musicgen_text":
        settings.update(guidance_scale=None)
    served = []
    real_run = _prepared.PreparedForward.run

    def counting_run(self, *args):
        out = real_run(self, *args)
        served.append(out is not None)
        return out
    monkeypatch.setattr(_prepared.PreparedForward, "run", counting_run)
    got = _outcome(lambda: model.generate(**inputs, **settings))
    monkeypatch.setattr(_prepared.PreparedForward, "run", lambda self, *args: None)
    want = _outcome(lambda: model.generate(**inputs, **settings))
    assert got[0] == want[0] and (torch.equal(got[1], want[1]) if want[0] else got[1] is want[1]), (got, want)
    if want[0]:  # (a release whose own generate raises on this path, as MusicGen's with a cache on 4.57, decodes none)
        backend = _dispatch.resolve_backend("auto", torch.device("cpu"), torch.float32)
        assert any(served) == (backend in PREPARED_BACKENDS), (backend, served)


def test_patch_twice_changes_nothing_more():
    model, original = _pair(family_named("m2m100"))
    pf.patch_model(model)
    forwards = {name: m.__dict__.get("forward") for name, m in model.named_modules()}
    pf.patch_model(model)
    assert forwards == {name: m.__dict__.get("forward") for name, m in model.named_modules()}
    ids = torch.randint(3, VOCAB, (2, 6))
    _close(_logits(model, dict(input_ids=ids, decoder_input_ids=ids)),
           _logits(original, dict(input_ids=ids, decoder_input_ids=ids)))


@pytest.mark.parametrize("version", ["4.56.2", "5.25.0", "6.0.0", "5.25.0.dev0", "3.5.1"])
def test_unsupported_transformers_release_leaves_the_model_unpatched(monkeypatch, version, seed):
    """A transformers release outside SUPPORTED_TRANSFORMERS gets a warning naming the version and an
    unpatched model: never different numbers."""
    model, original = _pair(family_named("m2m100"))
    monkeypatch.setattr(integration, "_installed_transformers_version", lambda: version)
    with pytest.warns(RuntimeWarning, match=f"transformers {version} is outside"):
        assert pf.patch_model(model) is model
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert not _patched_modules(model)
    ids = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(seed))
    torch.testing.assert_close(_logits(model, dict(input_ids=ids, decoder_input_ids=ids)),
                               _logits(original, dict(input_ids=ids, decoder_input_ids=ids)), atol=0, rtol=0)


def test_installed_transformers_is_a_supported_release():
    """The test extra resolves a supported release; this fails if it ever resolves one outside the range
    (the rest of this file would then test an unpatched model)."""
    assert integration._unsupported_transformers() is None, transformers.__version__


def test_position_module_whose_code_changed_is_left_unpatched_with_a_warning(monkeypatch, seed):
    """The patch restates each position module's rule; a release whose module numbers positions another
    way (here: Marian's, shifted by one) fails the patch-time probe, and that module keeps its own PE."""
    from transformers.models.marian import modeling_marian

    own = modeling_marian.MarianSinusoidalPositionalEmbedding.forward

    @functools.wraps(own)  # the same signature: only the probe can tell
    def shifted(self, *args, **kwargs):
        rows = own(self, *args, **kwargs)
        return torch.roll(rows, 1, dims=-2)

    monkeypatch.setattr(modeling_marian.MarianSinusoidalPositionalEmbedding, "forward", shifted)
    model, original = _pair(family_named("marian"))
    with pytest.warns(RuntimeWarning, match="left MarianEncoder.MarianSinusoidalPositionalEmbedding unpatched"):
        pf.patch_model(model)
    assert not _patched_modules(model)
    ids = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(seed))
    torch.testing.assert_close(_logits(model, dict(input_ids=ids, decoder_input_ids=ids)),
                               _logits(original, dict(input_ids=ids, decoder_input_ids=ids)), atol=0, rtol=0)


def test_unknown_argument_of_a_position_module_leaves_it_unpatched(monkeypatch):
    from transformers.models.m2m_100 import modeling_m2m_100

    cls = modeling_m2m_100.M2M100SinusoidalPositionalEmbedding
    own = cls.forward

    def renamed(self, input_ids=None, inputs_embeds=None, past_seen_tokens=0):
        return own(self, input_ids, inputs_embeds, past_seen_tokens)

    monkeypatch.setattr(cls, "forward", renamed)
    with pytest.warns(RuntimeWarning, match="takes 'past_seen_tokens'"):
        model = pf.patch_model(m2m100())
    assert not _patched_modules(model)


def test_unsupported_model_raises_and_changes_nothing():
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32)
    model = transformers.BertModel(config)
    before = {name: dict(m.__dict__) for name, m in model.named_modules()}
    with pytest.raises(TypeError, match="BertModel"):
        pf.patch_model(model)
    assert {name: dict(m.__dict__) for name, m in model.named_modules()} == before


def test_learned_position_embeddings_are_refused():
    config = transformers.DistilBertConfig(vocab_size=VOCAB, dim=D, n_layers=1, n_heads=2, hidden_dim=32,
                                           sinusoidal_pos_embds=False)
    with pytest.raises(ValueError, match="learned position embeddings"):
        pf.patch_model(transformers.DistilBertModel(config))


@pytest.mark.parametrize("family", [f for f in FAMILIES if f.tokens], ids=lambda f: f.name)
def test_user_inputs_embeds_get_the_pe_as_in_the_model(family, seed):
    """inputs_embeds instead of ids: the model's own path, with the exact PE."""
    model, original = _pair(family)
    generator = torch.Generator().manual_seed(seed)
    inputs = make_inputs(family, model, generator)
    for key in ("input_ids", "decoder_input_ids"):
        if key in inputs and family.kind != "kosmos2":
            ids = inputs.pop(key)
            # Rows at the scale of the model's own.  At twice that, FSMT on transformers 4.57.6 amplified the
            # PE's fp32 rounding past LOGITS_ATOL in 2 of 30,000 seeds (5x at worst); at this scale, in none
            # of 60,000 (0.58x at worst).
            inputs[key.replace("input_ids", "inputs_embeds")] = INIT_STD * torch.randn(*ids.shape, D,
                                                                                       generator=generator)
    pf.patch_model(model)
    _assert_same(lambda: _logits(model, inputs), lambda: _logits(original, inputs), _close)


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

    def cached_step(m):
        first = m(**inputs, decoder_input_ids=decoder, use_cache=True)
        return m(**inputs, decoder_input_ids=step, past_key_values=first.past_key_values, use_cache=True).logits

    with torch.no_grad():
        _assert_same(lambda: cached_step(model), lambda: cached_step(original), _close)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f.kind in ("speech", "whisper")], ids=lambda f: f.name)
def test_speech_encoder_outputs_hidden_states_and_attentions(family, seed):
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
        _close(got, want)


@pytest.mark.parametrize("family", families_for("compile"), ids=lambda f: f.name)
def test_patched_model_compiles_fullgraph(family, seed):
    """The patched position modules trace without graph breaks (no argument binding at call time)."""
    model, original, inputs = _patched_pair(family, seed)

    def compiled(m):  # against the compiled unpatched model: some releases do not compile fullgraph at all
        torch._dynamo.reset()
        return _logits(torch.compile(m, fullgraph=True, backend="aot_eager"), inputs)

    _assert_same(lambda: compiled(model), lambda: compiled(original), _close)


def test_pegasus_x_bf16_pe_is_exact_at_long_positions():
    """PegasusX computes its sinusoid in the embeddings' dtype: in bf16 the angle position * frequency is
    rounded to 8 bits, whole radians off at a few thousand positions.  Patched, the rows are the float64
    sinusoid rounded once to bf16."""
    model = pegasus_x()
    module = model.model.decoder.embed_positions
    embeds = torch.zeros(1, 8, D, dtype=torch.bfloat16)
    past = 4000
    unpatched = module(embeds, past).float()
    pf.patch_model(model)
    patched = module(embeds, past)
    assert patched.dtype == torch.bfloat16 and patched.shape == (1, 8, D)
    kw = pf.presets.get("whisper").kwargs(D)
    exact = pf.reference.sinusoidal_table(past + 8, D, layout=kw["layout"], frequencies=kw["frequencies"])[past:]
    assert torch.equal(patched[0], exact.to(torch.bfloat16))  # exact, then rounded once
    assert float((unpatched[0].double() - exact).abs().max()) > 0.1  # what it replaces


def test_deepcopy_and_pickle_keep_a_working_patch(tmp_path):
    """A deep copy or a pickled (torch.save) patched model runs its own modules, still patched."""
    model, original = _pair(family_named("m2m100"))
    pf.patch_model(model)
    ids = torch.randint(3, VOCAB, (2, 6))
    expected = _logits(original, dict(input_ids=ids, decoder_input_ids=ids))
    torch.save(model, tmp_path / "model.pt")
    for twin in (copy.deepcopy(model), torch.load(tmp_path / "model.pt", weights_only=False)):
        patched = _patched_modules(twin)
        assert len(patched) == 2 and all(m.forward.args[0] is m for m in patched)
        _close(_logits(twin, dict(input_ids=ids, decoder_input_ids=ids)), expected)


def _data_parallel_replica(module, dtype):
    """What nn.DataParallel's replicate() makes of ``module`` for another GPU (it needs GPUs; this runs
    anywhere): ``module._replicate_for_data_parallel()``, given its own copies of the parameters and
    buffers, here in ``dtype`` standing in for another device's."""
    replica = module._replicate_for_data_parallel()
    for name, parameter in module._parameters.items():
        if parameter is not None:
            setattr(replica, name, parameter.detach().to(dtype))
    for name, buffer in module._buffers.items():
        if buffer is not None:
            replica._buffers[name] = buffer.to(dtype) if buffer.is_floating_point() else buffer
    return replica


def test_data_parallel_replicas_compute_from_their_own_tables(family, seed):
    """nn.DataParallel copies each module's __dict__ into a replica that holds its own device's parameters and
    buffers.  A patched position module's replica computes from the replica's table (its device and dtype:
    float64 here), as the unpatched module's replica reads its own, not from the module it was copied from."""
    model, original, inputs = _patched_pair(family, seed)
    _skip_where_the_model_itself_fails(original, inputs)
    modules, unpatched = dict(model.named_modules()), dict(original.named_modules())
    names = {module: name for name, module in modules.items()}
    calls = {}  # name -> (args, kwargs) of the patched module's call in the model's forward
    handles = [m.register_forward_pre_hook(lambda m, args, kwargs: calls.setdefault(names[m], (args, kwargs)),
                                           with_kwargs=True) for m in _patched_modules(model)]
    _logits(model, inputs)
    for handle in handles:
        handle.remove()
    # (PegasusX's position module has no table: its PE takes the embeddings' dtype)
    with_tables = [name for name in calls if any(hasattr(modules[name], t) for t in ("weight", "weights"))]
    assert with_tables or family.name == "pegasus_x", calls.keys()
    for name in with_tables:
        args, kwargs = calls[name]
        with torch.no_grad():
            got = _data_parallel_replica(modules[name], torch.float64)(*args, **kwargs)
            expected = _data_parallel_replica(unpatched[name], torch.float64)(*args, **kwargs)
        assert got.dtype == expected.dtype == torch.float64, (name, got.dtype)
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


# ------------------------------------------------------------------ what users attach to the embeddings

TOKEN_FAMILIES = [f for f in FAMILIES if f.tokens]


def _token_lookups(model):
    """get_input_embeddings() and every other module that looks up the same table (in transformers 5.x a
    seq2seq model's encoder and decoder hold their own modules, tied to it: hooks on get_input_embeddings()
    itself do not fire there, patched or not)."""
    table = model.get_input_embeddings().weight
    return [m for m in model.modules() if isinstance(m, torch.nn.Embedding) and m.weight is table]


@pytest.mark.parametrize("family", TOKEN_FAMILIES, ids=lambda f: f.name)
def test_hooks_on_the_input_embeddings_fire(family, seed):
    """A forward hook on the input embeddings (NEFTune adds noise there) fires and takes effect."""
    model, original, inputs = _patched_pair(family, seed)
    _skip_where_the_model_itself_fails(original, inputs)
    calls = {"patched": 0, "unpatched": 0}

    def noisy(which):
        def hook(module, args, output):  # deterministic "noise", so both models get the same
            calls[which] += 1
            return output + 0.5 * torch.sin(torch.arange(output.numel(), dtype=output.dtype)).reshape(output.shape)
        return hook

    for m, which in ((model, "patched"), (original, "unpatched")):
        for module in _token_lookups(m):
            module.register_forward_hook(noisy(which))
    unhooked = _logits(copy.deepcopy(original).apply(lambda m: m._forward_hooks.clear()), inputs)
    _assert_same(lambda: _logits(model, inputs), lambda: _logits(original, inputs), _close)
    assert calls["patched"] == calls["unpatched"] > 0
    assert not torch.allclose(_logits(original, inputs), unhooked)  # the hook changes what it is compared on


def _neftune_hook():
    try:  # transformers 5.x
        from transformers.integrations.neftune import neftune_post_forward_hook
    except ImportError:  # 4.x
        from transformers.trainer_utils import neftune_post_forward_hook
    return neftune_post_forward_hook


@pytest.mark.parametrize("family", TOKEN_FAMILIES, ids=lambda f: f.name)
def test_neftune_noise_reaches_the_model(family, seed):
    """transformers' own NEFTune hook (what Trainer(neftune_noise_alpha=...) attaches), the same draws."""
    model, original, inputs = _patched_pair(family, seed)
    _skip_where_the_model_itself_fails(original, inputs)
    clean = copy.deepcopy(original).train()
    for m in (model, original):
        for embeddings in _token_lookups(m):
            embeddings.neftune_noise_alpha = 5.0
            embeddings.register_forward_hook(_neftune_hook())
        m.train()  # the noise applies in training only (the tiny configs have no dropout)

    def noisy_logits(m):
        torch.manual_seed(seed)
        return m(**inputs).logits.detach()

    _assert_same(lambda: noisy_logits(model), lambda: noisy_logits(original), _close)
    assert not torch.allclose(noisy_logits(original), noisy_logits(clean))  # the noise was there


LORA_FAMILIES = [f for f in TOKEN_FAMILIES if f.kind in ("seq2seq", "causal", "mlm")]


@pytest.mark.parametrize("family", LORA_FAMILIES, ids=lambda f: f.name)
def test_lora_on_the_token_embeddings(family, seed):
    """PEFT LoRA adapters on the token embedding modules: same logits and adapter gradients."""
    peft = pytest.importorskip("peft")
    model, original, inputs = _patched_pair(family, seed)
    table = model.get_input_embeddings().weight
    # The modules that look the table up: not the seq2seq models' ``shared`` where it only holds the tied
    # table (5.x), but ``shared`` where it is the encoder's and decoder's module too (4.x).
    holders = [name for name, m in model.named_modules() if isinstance(m, torch.nn.Embedding) and m.weight is table]
    targets = [name for name in holders if not name.endswith("shared")] or holders
    adapted = []
    for m in (model, original):
        torch.manual_seed(seed)  # init_lora_weights=False draws both factors: the same draw for both
        adapted.append(peft.get_peft_model(m, peft.LoraConfig(r=2, target_modules=targets, init_lora_weights=False)))

    def step(m):
        m.train()
        _loss(m, inputs).backward()
        return {name: p.grad for name, p in m.named_parameters() if "lora_" in name}

    def same(got, expected):
        assert got.keys() == expected.keys() and got
        _assert_same_gradients(adapted[0], adapted[1])

    _assert_same(lambda: _logits(adapted[0], inputs), lambda: _logits(adapted[1], inputs), _close)
    _assert_same(lambda: step(adapted[0]), lambda: step(adapted[1]), same)


def _token_side(model):
    embedding = model.get_input_embeddings()
    for module in model.modules():
        if getattr(module, "embed_tokens", None) is embedding and hasattr(module, "embed_scale"):
            return module
    return None


@pytest.mark.parametrize("family", TOKEN_FAMILIES, ids=lambda f: f.name)
def test_replaced_rescaled_and_resized_embeddings_are_used(family, seed):
    """set_input_embeddings, an edited embed_scale and resize_token_embeddings (bigger, and below the
    padding id) after patching: read at call time, as unpatched."""
    model, original, inputs = _patched_pair(family, seed)
    torch.manual_seed(seed)
    replacement = torch.nn.Embedding(VOCAB, D, padding_idx=PAD)
    for m in (model, original):
        m.set_input_embeddings(copy.deepcopy(replacement))
    _assert_same(lambda: _logits(model, inputs), lambda: _logits(original, inputs), _close)
    for m in (model, original):
        side = _token_side(m)
        if side is not None:
            side.embed_scale = 3.0
    _assert_same(lambda: _logits(model, inputs), lambda: _logits(original, inputs), _close)
    for size in (VOCAB + 5, PAD):
        for m in (model, original):
            torch.manual_seed(seed)  # new rows are drawn (mean resizing): the same draw for both
            _outcome(lambda: m.resize_token_embeddings(size))
        small = {k: (v.clamp(max=size - 1) if k.endswith("input_ids") else v) for k, v in inputs.items()}
        _assert_same(lambda: _logits(model, small), lambda: _logits(original, small), _close)


# ----------------------------------------------------------------------------- loads, tables, DDP

def _sinusoid_table_names(model):
    """Names (in state_dict / named_buffers) of the tables of the position modules patch_model patches."""
    patched = _pair_patch_targets(model)
    return {name for name, tensor in list(model.named_parameters()) + list(model.named_buffers())
            if any(tensor is integration._table_of(m) for m in patched)}


def _pair_patch_targets(model):
    patches = [integration._family_of(m)(m) for m in model.modules() if integration._family_of(m) is not None]
    return [patch.module for patch in patches if patch is not None]


# Where a model built under ``with torch.device("meta")`` is patched: still inside that context (before
# to_empty, as the flow reads naturally), or after leaving it.
META_PATCH_PLACES = ["inside_meta_context", "after_meta_context"]


def _built_on_meta(family, patch_where=None):
    """The family's model built under ``torch.device("meta")``; patched inside the context or after it."""
    with torch.device("meta"):
        torch.manual_seed(1234)
        model = family.build().eval()
        if patch_where == "inside_meta_context":
            pf.patch_model(model)
    if patch_where == "after_meta_context":
        pf.patch_model(model)
    return model


def _copy_buffers_not_in(model, state, reference):
    """Buffers that load_state_dict does not carry (non-persistent ones), from ``reference``."""
    reference_buffers = dict(reference.named_buffers())
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name not in state:
                buffer.copy_(reference_buffers[name])


@pytest.mark.parametrize("where", META_PATCH_PLACES)
@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_built_on_meta_patched_and_loaded_without_position_tables(family, where, seed):
    """Patched on meta, materialised with to_empty and loaded from a state dict without its sinusoidal
    tables (their memory is then garbage, here NaN): the patched model computes the PE and is right."""
    model_ref, _ = _pair(family)
    model = _built_on_meta(family, where)
    assert _patched_modules(model)
    model.to_empty(device="cpu")
    tables = _sinusoid_table_names(model)
    assert tables or all(integration._table_of(m) is None for m in _pair_patch_targets(model))  # PegasusX: none
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if name in tables:
                tensor.fill_(float("nan"))
    state = {k: v for k, v in model_ref.state_dict().items() if k not in tables}
    _, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected
    # Other buffers that load_state_dict does not carry (non-persistent position ids) from the reference.
    _copy_buffers_not_in(model, set(state) | tables, model_ref)
    inputs = make_inputs(family, model, torch.Generator().manual_seed(seed))
    _assert_same(lambda: _logits(model, inputs), lambda: _logits(model_ref, inputs), _close)


@pytest.mark.parametrize("how", ["init_weights", "state_dict"])
@pytest.mark.parametrize("where", META_PATCH_PLACES)
@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_built_on_meta_and_materialised_as_the_unpatched_model(family, where, how, seed):
    """A patched and an unpatched model built on meta, both materialised the same way (to_empty, then
    transformers' own init_weights from the same seed, or the same full state dict): the same outputs.  On
    meta there are no table values to check, so the patch applies unchecked."""
    model = _built_on_meta(family, where)
    original = _built_on_meta(family)
    assert _patched_modules(model) and not _patched_modules(original)
    reference, _ = _pair(family)
    for m in (model, original):
        m.to_empty(device="cpu")
        if how == "init_weights":
            with torch.no_grad():  # what init_weights leaves (EnCodec's weight norm) the same in both: NaN
                for tensor in list(m.parameters()) + list(m.buffers()):
                    tensor.fill_(float("nan") if tensor.is_floating_point() else 0)
            torch.manual_seed(seed)
            m.init_weights()
        else:
            state = reference.state_dict()
            m.load_state_dict(state)
            _copy_buffers_not_in(m, state, reference)
    assert model.state_dict().keys() == original.state_dict().keys()
    for name, value in original.state_dict().items():  # the same weights: the patch drew nothing
        torch.testing.assert_close(model.state_dict()[name], value, atol=0, rtol=0, equal_nan=True,
                                   msg=lambda m: f"{name}: {m}")
    inputs = make_inputs(family, model, torch.Generator().manual_seed(seed))
    ran, logits = _outcome(lambda: _logits(original, inputs))
    if how == "init_weights" and ran and not bool(logits.isfinite().all()):
        pytest.skip(f"transformers {transformers.__version__}'s init_weights leaves a model materialised with "
                    "to_empty uninitialised (its unpatched outputs are not finite)")
    _assert_same(lambda: _logits(model, inputs), lambda: _logits(original, inputs), _close)


DEFAULT_DEVICES = ["meta", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                           reason="no CUDA device"))]


@pytest.mark.parametrize("default_device", DEFAULT_DEVICES)
@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_patched_under_another_default_device(family, default_device, seed):
    """patch_model under a default device other than CPU: its probe runs on CPU tensors of its own.  Under
    meta, a model built on CPU is patched (its tables checked against their values) and gives the unpatched
    model's outputs; under cuda, a model built and patched there gives its unpatched twin's outputs there."""
    device = "cpu" if default_device == "meta" else default_device
    with torch.device(device):
        torch.manual_seed(1234)
        model = family.build().eval()
    original = copy.deepcopy(model)
    rng = torch.get_rng_state()
    with torch.device(default_device):
        assert pf.patch_model(model) is model
    assert torch.equal(torch.get_rng_state(), rng)  # the probe drew from a generator of its own
    assert _patched_modules(model)
    inputs = {key: value.to(device) for key, value in
              make_inputs(family, model, torch.Generator().manual_seed(seed)).items()}
    with torch.device(device):
        _assert_same(lambda: _logits(model, inputs), lambda: _logits(original, inputs), _close)


@pytest.mark.parametrize("family", families_for("device_map"), ids=lambda f: f.name)
def test_device_map_load_with_broken_position_tables(family, seed, tmp_path):
    """from_pretrained(device_map=...) whose position tables came back wrong: a frozen table or buffer
    cannot have been trained, so the patch warns and computes the right PE; a trainable one might have
    been fine-tuned, so the patch refuses and names ignore_table_values=True, which then gives the right PE."""
    model_ref, _ = _pair(family)
    inputs = make_inputs(family, model_ref, torch.Generator().manual_seed(seed))
    _skip_where_the_model_itself_fails(model_ref, inputs)
    model_ref.save_pretrained(tmp_path)
    model = type(model_ref).from_pretrained(tmp_path, device_map="cpu").eval()
    tables = _pair_patch_targets(model)
    with torch.no_grad():
        for table in tables:
            integration._table_of(table).mul_(-1.5)  # as a broken load leaves it
    trainable = any(integration._table_of(t).requires_grad for t in tables)
    if trainable:
        with pytest.raises(ValueError, match="ignore_table_values=True"):
            pf.patch_model(model)
        assert not _patched_modules(model)
        pf.patch_model(model, ignore_table_values=True)
    else:
        with pytest.warns(RuntimeWarning, match="never reads that table"):
            pf.patch_model(model)
    assert _patched_modules(model)
    _close(_logits(model, inputs), _logits(model_ref, inputs))
    # Made trainable, such a table is not read (it is wrong): the call raises naming it; frozen again, it runs.
    read = _read_tables(model)
    for table in read:
        table.requires_grad_(True)
        name = next(n for n, p in model.named_parameters() if p is table)
        with pytest.raises(RuntimeError, match=f"{name} requires grad.*requires_grad_\\(False\\)"):
            _logits(model, inputs)
        table.requires_grad_(False)
    _close(_logits(model, inputs), _logits(model_ref, inputs))


@pytest.mark.parametrize("family", families_for("offload"), ids=lambda f: f.name)
def test_accelerate_offload_hooks_are_kept(family, seed):
    """accelerate's hooks (device_map, offloading) wrap each module's forward: the patch replaces what
    they wrap, so the weights still reach the execution device first and the hook stays."""
    accelerate = pytest.importorskip("accelerate")
    model, original = _pair(family)
    inputs = make_inputs(family, model, torch.Generator().manual_seed(seed))
    _skip_where_the_model_itself_fails(original, inputs)
    accelerate.cpu_offload(model, execution_device=torch.device("cpu"))
    pf.patch_model(model)
    patched = _patched_modules(model)
    assert patched and all(getattr(m, "_hf_hook", None) is not None for m in patched)
    _close(_logits(model, inputs), _logits(original, inputs))


def _read_tables(model):
    """The patched position modules' tables that are Parameters (those a user can make trainable)."""
    return [integration._table_of(m) for m in _patched_modules(model)
            if isinstance(integration._table_of(m), torch.nn.Parameter)]


def _read_tables_of_unpatched(original, model, read):
    """The Parameters of ``original`` named as the tables ``read`` are named in ``model``."""
    names = {id(p): name for name, p in model.named_parameters()}
    twins = dict(original.named_parameters())
    return [twins[names[id(table)]] for table in read]


def _reading_warnings(call):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = call()
    return result, [w for w in caught if "so its patched position module reads it" in str(w.message)]


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_tables_made_trainable_after_patching_train_as_unpatched(family, seed):
    """``for p in model.parameters(): p.requires_grad_(True)`` after patching, as fine-tuning every weight
    (and transformers' gradient-checkpointing tests) do: each position table that is a Parameter gets the
    unpatched model's gradient, one SGD step moves every weight as unpatched, each such module warns once,
    and a table trained so is still read once frozen again."""
    model, original, inputs = _patched_pair(family, seed)
    _skip_where_the_model_itself_fails(original, inputs)
    read = _read_tables(model)
    for m in (model, original):
        m.train()
        for parameter in m.parameters():
            parameter.requires_grad_(True)
    loss, said = _reading_warnings(lambda: _loss(model, inputs))
    assert len(said) == len(read), [str(w.message) for w in said]
    names = {name for name, p in model.named_parameters() if any(p is table for table in read)}
    assert all(any(name in str(w.message) for w in said) for name in names)
    loss.backward()
    _loss(original, inputs).backward()
    _assert_same_gradients(model, original)  # the tables' gradients included (None where unpatched has none)
    before = [table.detach().clone() for table in read]
    for m in (model, original):
        torch.optim.SGD(m.parameters(), lr=0.1).step()
    expected = dict(original.named_parameters())
    largest = max(float(p.abs().max()) for p in expected.values())
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(parameter, expected[name], atol=GRAD_RTOL * largest, rtol=GRAD_RTOL,
                                   msg=lambda m: f"{name}: {m}")
    # The tables moved (as unpatched: 4.x's Marian and Pegasus read theirs under no_grad, and keep them).
    twins = _read_tables_of_unpatched(original, model, read)
    assert [not torch.equal(t, old) for t, old in zip(read, before)] == [t.grad is not None for t in twins]
    model.eval()
    original.eval()

    def same_logits():
        got = _logits(model, inputs)
        if len(read) == len(_patched_modules(model)):  # every patched module runs its own forward: bit for bit
            torch.testing.assert_close(got, _logits(original, inputs), atol=0, rtol=0)
        else:  # computed PE (buffer tables): its rounding reaches the gradients, checked above, and the step can
            # amplify that past GRAD_RTOL in the logits (Kosmos-2's image rows, some draws): so on our weights
            twin = copy.deepcopy(original)
            twin.load_state_dict(model.state_dict())
            expected = _logits(twin, inputs)
            torch.testing.assert_close(got, expected, atol=GRAD_RTOL * float(expected.abs().max()), rtol=0)

    _, said = _reading_warnings(same_logits)
    assert not said  # once per module
    for m in (model, original):  # frozen again: the trained tables are still what the model reads
        m.requires_grad_(False)
    same_logits()


DDP_FAMILIES = [f for f in FAMILIES if f.trainable_pe]


def _ddp_rank(rank, world, family_name, initial, inputs, result_path):
    import torch.distributed  # noqa: F401 - the process group is up (run_gloo_rank)

    family = family_named(family_name)
    model = family.build()
    model.load_state_dict(initial)
    pf.patch_model(model)
    model.train()
    wrapped = torch.nn.parallel.DistributedDataParallel(model)  # default arguments
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    share = {k: v[rank::world] for k, v in inputs.items()}
    for _ in range(2):  # the second step is where an unused trainable Parameter makes DDP raise
        optimizer.zero_grad()
        _loss(wrapped, share).backward()
        optimizer.step()
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, result_path)


@pytest.mark.parametrize("family", DDP_FAMILIES, ids=lambda f: f.name)
def test_plain_ddp_trains_a_patched_model_with_sinusoidal_tables(family, seed, tmp_path):
    """DistributedDataParallel(model) with default arguments, two gloo ranks: trains, and ends where one
    process on the whole batch ends."""
    import torch.multiprocessing as mp
    from test_distributed import _free_port, run_gloo_rank

    torch.manual_seed(1234)
    reference_model = family.build()
    initial = {k: v.clone() for k, v in reference_model.state_dict().items()}
    inputs = make_inputs(family, reference_model, torch.Generator().manual_seed(seed))
    inputs = {k: v[:2] for k, v in inputs.items()}  # two rows: one per rank
    _skip_where_the_model_itself_fails(reference_model, inputs)
    if family.kind == "seq2seq":
        inputs["decoder_input_ids"][:, -2:] = 5  # no padding in the labels
    pf.patch_model(reference_model)
    reference_model.train()
    optimizer = torch.optim.SGD(reference_model.parameters(), lr=0.1)
    for _ in range(2):
        optimizer.zero_grad()
        # DDP averages the ranks' gradients: the whole batch's loss is their mean
        (0.5 * sum(_loss(reference_model, {k: v[r:r + 1] for k, v in inputs.items()}) for r in range(2))).backward()
        optimizer.step()
    result_path = str(tmp_path / "final.pt")
    mp.spawn(run_gloo_rank, args=(2, _free_port(), _ddp_rank, family.name, initial, inputs, result_path), nprocs=2,
             join=True)
    got = torch.load(result_path)
    for name, value in reference_model.state_dict().items():
        # (two ranks sum their gradients in another order than one process: rounding, after two SGD steps)
        torch.testing.assert_close(got[name], value, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("family", families_for("static_cache"), ids=lambda f: f.name)
def test_compiled_static_cache_generation_gives_the_same_tokens(family, seed):
    """generate(cache_implementation="static", compile_config=CompileConfig(fullgraph=True))."""
    compile_config = getattr(transformers, "CompileConfig", None)
    if compile_config is None:
        pytest.skip("this transformers has no CompileConfig")
    model, original, inputs = _patched_pair(family, seed)
    inputs.pop("decoder_input_ids")
    config = compile_config(fullgraph=True, backend="aot_eager")
    config._compile_all_devices = True  # transformers compiles on accelerators only unless told (CI is a CPU)
    settings = dict(max_new_tokens=4, do_sample=False, cache_implementation="static", compile_config=config)
    # Against the unpatched model's eager generation: on 4.57 the unpatched M2M100 does not compile
    # fullgraph here at all (its table-growth check branches on the cache length), the patched one does.
    expected = original.generate(**inputs, **dict(settings, compile_config=None))

    def compiled(m):
        torch._dynamo.reset()
        return m.generate(**inputs, **settings)

    ok, got = _outcome(lambda: compiled(model))
    if not ok:  # allowed only where the model's own code does not compile either (5.0's M2M100 logs in it)
        unpatched_ok, unpatched = _outcome(lambda: compiled(original))
        assert not unpatched_ok and unpatched is got, (got, unpatched)
        pytest.skip(f"{type(model).__name__} does not compile fullgraph on transformers {transformers.__version__}, "
                    f"patched or not ({got.__name__})")
    torch.testing.assert_close(got, expected, atol=0, rtol=0)


# --- Deploy through optimum-onnx ------------------------------------------------------------------------
# optimum-onnx 0.1.0 needs transformers < 4.58, so these tests run where .ci/run tests transformers
# 4.57.6 (with the [test-optimum] extra); with a newer transformers they skip and say why.
OPTIMUM_FAMILIES = families_for("optimum")


def _optimum():
    """(ORTModelForSeq2SeqLM, onnx_export_from_model), or a skip that says why there are none."""
    if integration._release(transformers.__version__) >= (4, 58):
        pytest.skip(f"optimum-onnx needs transformers < 4.58, this is {transformers.__version__}; .ci/run runs "
                    "these tests on 4.57.6 with the [test-optimum] extra")
    runtime = pytest.importorskip("optimum.onnxruntime", reason="optimum-onnx is not installed: the "
                                  "[test-optimum] extra installs it (with a transformers < 4.58)")
    exporters = pytest.importorskip("optimum.exporters.onnx", reason="optimum-onnx's exporter is not installed")
    return runtime.ORTModelForSeq2SeqLM, exporters.onnx_export_from_model


def _assert_runtime_matches(model, session_model, seed):
    """Logits of one forward with padding, and greedy tokens decoded step by step with the cache (the
    exported decoder with past), the ONNX Runtime model against the eager model."""
    inputs = make_inputs(Family("", None, "seq2seq"), model, torch.Generator().manual_seed(seed))
    with torch.no_grad():
        expected = model(**inputs).logits
    got = session_model(**inputs).logits
    # (ONNX Runtime sums in other orders than torch, and a model loaded unpatched reads its fp32 tables)
    _close(got, expected)
    inputs.pop("decoder_input_ids")
    settings = dict(max_new_tokens=8, do_sample=False, num_beams=1, use_cache=True)
    with torch.no_grad():
        expected = model.generate(**inputs, **settings)
    torch.testing.assert_close(session_model.generate(**inputs, **settings), expected, atol=0, rtol=0)


@pytest.mark.parametrize("family", OPTIMUM_FAMILIES, ids=lambda f: f.name)
def test_optimum_exports_a_fine_tuned_patched_model_from_its_directory(family, seed, tmp_path):
    """The deploy path: train patched, save_pretrained, ORTModelForSeq2SeqLM.from_pretrained(dir,
    export=True) (optimum loads the saved model unpatched and exports it); ONNX Runtime then decodes
    the patched eager model's tokens."""
    session_class, _ = _optimum()
    model, _, inputs = _patched_pair(family, seed)
    model.train()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    for _ in range(3):
        _loss(model, inputs).backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    model.save_pretrained(tmp_path)
    _assert_runtime_matches(model, session_class.from_pretrained(tmp_path, export=True), seed)


@pytest.mark.parametrize("family", OPTIMUM_FAMILIES, ids=lambda f: f.name)
def test_optimum_exports_a_patched_model_in_process(family, seed, tmp_path):
    """optimum's exporter on the patched model object (TorchScript-based: it traces, and a patched
    position module passes explicit positions, so its PE is exported as standard operators); the
    encoder, the decoder and the decoder with past run in ONNX Runtime as the eager model does."""
    session_class, export = _optimum()
    import onnx

    model, _, _ = _patched_pair(family, seed)
    export(model, tmp_path, task="text2text-generation-with-past")
    encoder_ops = {node.op_type for node in onnx.load(str(tmp_path / "encoder_model.onnx")).graph.node}
    assert {"Sin", "Cos"} <= encoder_ops, "the patched position module's PE is not in the exported encoder"
    _assert_runtime_matches(model, session_class.from_pretrained(tmp_path), seed)


# --- transformers' own exporters (5.x: transformers.exporters) ---------------------------------------
EXPORTER_FAMILIES = families_for("exporters")


def _exporters(backend: str):
    """(exporter, config with dynamic shapes) of transformers' own exporters, or a skip that says why."""
    exporters = pytest.importorskip("transformers.exporters", reason=f"transformers {transformers.__version__} has "
                                    "no transformers.exporters (later 5.x releases have)")
    if backend == "onnx":
        pytest.importorskip("onnxscript", reason="transformers' ONNX exporter needs onnxscript (the [test] extra)")
        make_exporter, make_config = exporters.OnnxExporter, exporters.OnnxConfig
    else:
        make_exporter, make_config = exporters.DynamoExporter, exporters.DynamoConfig
    try:
        exporter = make_exporter()
    except ImportError as refusal:
        # The exporter checks its environment when it is made (transformers 5.24's want torch >= 2.11, which
        # pip does not enforce): nothing of ours has run yet, so there is nothing to test on this torch.
        reason = (str(refusal).splitlines() or [""])[0]
        if "torch" not in reason:
            raise
        pytest.skip(f"transformers {transformers.__version__}'s {make_exporter.__name__} refuses torch "
                    f"{torch.__version__}: {reason}")
    return exporter, make_config(dynamic=True)


def _other_sizes(family: Family, inputs: dict) -> dict:
    """Inputs of another batch size, and for token models another length, than ``inputs``."""
    other = {key: value[:2] for key, value in inputs.items()}
    if family.kind in ("causal", "mlm", "seq2seq"):
        other["input_ids"] = torch.cat([other["input_ids"], other["input_ids"][:, 2:6]], dim=1)
        other["attention_mask"] = torch.cat([other["attention_mask"], torch.ones_like(other["attention_mask"][:, :4])], 1)
    return other


def _runner_inputs(runner, inputs: dict) -> dict:
    """What a component was traced with, from a forward's full keyword arguments (copied: caches grow)."""
    return {key: copy.deepcopy(value) for key, value in inputs.items() if key in runner.metadata.kwargs}


def _next_step(inputs: dict, logits: torch.Tensor, cache) -> dict:
    """A greedy decoding step's inputs after ``inputs``: the next token, the grown cache and mask."""
    step = dict(inputs, past_key_values=cache)
    token = logits[:, -1:].argmax(-1)
    if "decoder_input_ids" in inputs:  # seq2seq: the mask is the encoder's and stays
        step["decoder_input_ids"] = token
    else:
        step["input_ids"] = token
        step["attention_mask"] = torch.cat([inputs["attention_mask"], torch.ones_like(token)], dim=1)
    for key in ("position_ids", "cache_position"):
        if inputs.get(key) is not None:
            step[key] = inputs[key][..., -1:] + 1
    return step


def _check_exports(family: Family, model, inputs: dict, exporter, config, cache: str) -> None:
    """Exports ``model`` as transformers' own export tests do and checks each exported graph against the
    model's eager outputs: the forward at another batch size and length; for generating models, the
    prefill and multi-token decode components (export_for_generation) with the model's own growing
    DynamicCache, the decode driven for three steps so that the cache length varies, or (``cache=
    "static"``) with a StaticCache, one decode step."""
    exported = exporter.export(model, copy.deepcopy(inputs), config)
    other = _other_sizes(family, inputs)
    got = exported(**_runner_inputs(exported.runners["model"], other))
    _close(got["logits"] if isinstance(got, dict) else got.logits, _logits(model, other))
    if not family.generates:
        return
    from transformers.exporters.utils import decompose_for_generation

    prompt = {key: value for key, value in other.items() if key != "decoder_input_ids"}
    generation = dict(multi_token_decode=True, generation_config=transformers.GenerationConfig(
        use_cache=True, **(dict(cache_implementation="static", max_cache_len=64) if cache == "static" else {})))
    stages = decompose_for_generation(model, copy.deepcopy(prompt), **generation)
    components = exporter.export_for_generation(model, copy.deepcopy(prompt), config, **generation).runners
    steps = [("prefill", stages["prefill"][1])]
    step = stages["decode"][1]
    for _ in range(3 if cache == "dynamic" else 1):
        steps.append(("decode", step))
        with torch.no_grad():
            eager = model(**copy.deepcopy(step))
        if getattr(eager, "past_key_values", None) is None:  # no cache (XLM): one decode graph per length
            break
        step = _next_step(step, eager.logits, eager.past_key_values)
    for name, step_inputs in steps:
        out = components[name](**_runner_inputs(components[name], step_inputs))
        _close(out["logits"] if isinstance(out, dict) else out.logits, _logits(model, copy.deepcopy(step_inputs)))


def _exporter_params():
    """Every exporter family through DynamoExporter with a dynamic cache (the default run).  Marked slow (up
    to 2 minutes each on two cores): the static cache through DynamoExporter on ``costly``'s
    "exporters_static" families (Marian's decoder, Whisper's encoder), and OnnxExporter on its
    "exporters_onnx" ones (XGLM's decoder with its cache, DistilBERT).  OnnxExporter translates the program
    that Dynamo exported into the same standard ops whatever the family or cache, so the programs are
    checked where they are made, in Dynamo's export (tests/test_onnx.py takes a patched Marian through
    torch.onnx in the default run)."""
    params = []
    for family in EXPORTER_FAMILIES:
        params.append(pytest.param(family, "dynamic", "dynamo", id=f"{family.name}-dynamic-dynamo"))
        slow_cases = [("dynamic", "onnx")] if "exporters_onnx" in family.costly else []
        if family.generates and "exporters_static" in family.costly:
            slow_cases.append(("static", "dynamo"))
        params += [pytest.param(family, cache, backend, id=f"{family.name}-{cache}-{backend}", marks=pytest.mark.slow)
                   for cache, backend in slow_cases]
    return params


@pytest.mark.parametrize("family,cache,backend", _exporter_params())
def test_transformers_exporters_with_dynamic_shapes(family, cache, backend, seed):
    """transformers' DynamoExporter / OnnxExporter with dynamic shapes (``_check_exports``): every graph the
    unpatched model exports right, the patched one does too.  Where the unpatched model fails (an export,
    or a graph that specialised a size), the patched one passes every check or fails the same way (FSMT's
    static-cache decode exports only patched: its table-growth check reads a tensor's value)."""
    exporter, config = _exporters(backend)
    model, original, inputs = _patched_pair(family, seed)
    unpatched = _outcome(lambda: _check_exports(family, original, inputs, exporter, config, cache))
    if unpatched[0]:
        _check_exports(family, model, inputs, exporter, config, cache)
        return
    patched = _outcome(lambda: _check_exports(family, model, inputs, exporter, config, cache))
    if patched[0]:
        return
    assert patched == unpatched, (patched, unpatched)
    pytest.skip(f"{type(model).__name__} fails transformers' {backend} export checks patched or not ({unpatched[1]})")
