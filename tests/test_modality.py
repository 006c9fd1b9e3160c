"""Output modalities: strict canonical parsing, default keys, key normalization, DELTA accumulation."""

import pytest
import torch

from engine.modality import (
    VALID_MODALITY_NAMES,
    Accumulation,
    ModalityError,
    OutputAccumulator,
    OutputModality,
    default_output_key,
    normalize_output_keys,
    parse_output_modalities,
)

T, IMG, A, L, K = (
    OutputModality.TEXT,
    OutputModality.IMAGE,
    OutputModality.AUDIO,
    OutputModality.LATENT,
    OutputModality.TOKEN_IDS,
)


@pytest.mark.parametrize(
    "value, expected",
    [
        ("text", (T,)),
        ("image", (IMG,)),
        ("audio", (A,)),
        ("latent", (L,)),
        ("token_ids", (K,)),
        ("text+image", (T, IMG)),
        ("image,text", (IMG, T)),
        ("token_ids+text", (K, T)),
        ("text+image,audio", (T, IMG, A)),
        (None, (T,)),
    ],
)
def test_canonical_names_and_combinations_parse(value, expected):
    assert parse_output_modalities(value) == expected


@pytest.mark.parametrize(
    "value, fragment",
    [
        ("latents", "unknown output modality 'latents'"),
        ("tokens", "unknown output modality 'tokens'"),
        ("images", "unknown output modality 'images'"),
        ("speech", "unknown output modality 'speech'"),
        ("wav", "unknown output modality 'wav'"),
        ("token-ids", "unknown"),
        ("Image", "unknown output modality 'Image'"),
        ("TEXT", "unknown"),
        (" text", "whitespace"),
        ("text ", "whitespace"),
        ("text + image", "whitespace"),
        ("text\t", "whitespace"),
        ("text+", "empty component"),
        ("+image", "empty component"),
        ("text,,image", "empty component"),
        ("+", "empty component"),
        ("", "empty"),
        ("text+text", "repeated"),
        ("video", "unknown"),
    ],
)
def test_bad_spellings_are_rejected_with_the_valid_names(value, fragment):
    with pytest.raises(ModalityError) as info:
        parse_output_modalities(value)
    message = str(info.value)
    assert fragment in message
    for name in VALID_MODALITY_NAMES:
        assert name in message


def test_explicit_empty_is_an_error_not_the_default():
    assert parse_output_modalities(None) == (T,)
    with pytest.raises(ModalityError, match="empty"):
        parse_output_modalities("")


def test_non_string_is_rejected():
    with pytest.raises(ModalityError, match="must be a string"):
        parse_output_modalities(["text"])  # type: ignore[arg-type]


def test_token_ids_is_its_own_type_with_its_own_key():
    assert default_output_key(K) == "token_ids"
    assert default_output_key(T) == "text"
    assert K is not T


@pytest.mark.parametrize("generic", ["model_outputs", "hidden"])
def test_generic_producer_keys_take_the_declared_key_without_touching_values(generic):
    ids = torch.tensor([5, 6, 7])
    normalized = normalize_output_keys({generic: ids}, K)
    assert list(normalized) == ["token_ids"]
    assert normalized["token_ids"] is ids  # renamed, not converted or copied
    latent = torch.zeros(2, 4)
    assert normalize_output_keys({generic: latent}, L)["latent"] is latent


def test_explicit_auxiliary_keys_are_kept():
    aux = torch.tensor([1, 2])
    normalized = normalize_output_keys({"prior_image": aux, "model_outputs": torch.tensor([3])}, K)
    assert normalized["prior_image"] is aux
    assert set(normalized) == {"prior_image", "token_ids"}


def test_generic_key_does_not_overwrite_an_explicit_default_key():
    explicit = torch.tensor([1])
    normalized = normalize_output_keys({"token_ids": explicit, "hidden": torch.tensor([9])}, K)
    assert normalized["token_ids"] is explicit
    assert "hidden" in normalized


def test_token_ids_accumulate_on_dim0_and_are_retained_across_deltas():
    acc = OutputAccumulator((K,))
    acc.add({"model_outputs": torch.tensor([1, 2])})
    assert acc.deliver()["token_ids"].tolist() == [1, 2]
    acc.add({"token_ids": torch.tensor([3])})
    acc.add({"token_ids": torch.tensor([4, 5])})
    assert acc.deliver()["token_ids"].tolist() == [1, 2, 3, 4, 5]
    assert acc.deliver()["token_ids"].tolist() == [1, 2, 3, 4, 5]  # still there after delivery


def test_text_and_latent_are_retained_image_and_audio_drained():
    acc = OutputAccumulator((T, IMG, A, L))
    acc.add({"text": "hel", "image": ["frame-1"], "audio": torch.ones(2), "latent": torch.zeros(1, 3)})
    acc.add({"text": "lo", "latent": torch.zeros(1, 3)})
    first = acc.deliver()
    assert first["text"] == "hello"
    assert first["latent"].shape == (2, 3)
    assert first["image"] == ["frame-1"] and first["audio"].shape == (2,)
    second = acc.deliver()
    assert second["text"] == "hello" and second["latent"].shape == (2, 3)
    assert "image" not in second and "audio" not in second


def test_per_key_strategy_takes_precedence_over_the_modality_default():
    acc = OutputAccumulator((K,), key_strategies={"token_ids": Accumulation.REPLACE})
    acc.add({"token_ids": torch.tensor([1, 2])})
    acc.add({"token_ids": torch.tensor([3])})
    assert acc.deliver()["token_ids"].tolist() == [3]


def test_auxiliary_keys_are_replaced_and_kept():
    acc = OutputAccumulator((K,))
    acc.add({"prior_image": torch.tensor([1])})
    acc.add({"prior_image": torch.tensor([2])})
    assert acc.deliver()["prior_image"].tolist() == [2]
    assert acc.deliver()["prior_image"].tolist() == [2]
