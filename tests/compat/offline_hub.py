"""What Accelerate's example scripts download, made here, small and offline.

The scripts load GLUE/MRPC and wikitext with `datasets.load_dataset`, a metric
with `evaluate.load`, bert-base-cased / SmolLM with `from_pretrained`, and a
ResNet with `timm.create_model(pretrained=True)`. `install()` makes those calls
return, with no network:

- a synthetic MRPC-shaped `DatasetDict` (sentence1, sentence2, label, idx) and
  a wikitext-shaped one (text, with empty lines), real `datasets` objects;
- a word-level tokenizer (`tokenizers`, wrapped as transformers'
  `PreTrainedTokenizerFast`) over their vocabulary;
- a tiny BERT classifier and a tiny Llama, real transformers models built from
  configs with the current random state (seeded by the scripts);
- GLUE/MRPC's metric (accuracy and F1, as the `glue` metric computes them);
- a tiny image classifier with timm's `default_cfg` and `get_classifier()`.

torchvision's package-index wheel is built for CUDA torch and does not import
with the CPU build, and timm needs torchvision; where they cannot be imported,
stand-ins with the few names the scripts use take their place.

`OFFLINE_HUB_MAX_BATCH=N` makes the models raise torch's out-of-memory error
for training batches larger than N, as a device would, so that
`find_executable_batch_size` has something to find.
"""

from __future__ import annotations

import os
import random
import sys
import types
from pathlib import Path

import torch

WORDS = (
    "the a cat dog bird fish runs sleeps eats jumps over under near big small red blue "
    "green quick slow happy sad house tree river stone market city night day sun moon "
    "old new bright dark loud quiet"
).split()
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "</s>"]
MAX_LENGTH = 64
IMAGE_CLASSES = ("Abyssinian", "beagle", "boxer")


def _sentence(rng: random.Random) -> list[str]:
    return [rng.choice(WORDS) for _ in range(rng.randint(4, 9))]


def _mrpc_rows(count: int, seed: int) -> dict[str, list]:
    """Sentence pairs; label 1 when the second is the first reordered with one word changed."""
    rng = random.Random(seed)
    rows: dict[str, list] = {"sentence1": [], "sentence2": [], "label": [], "idx": []}
    for index in range(count):
        first = _sentence(rng)
        label = rng.random() < 0.5
        if label:
            second = first[:]
            rng.shuffle(second)
            second[rng.randrange(len(second))] = rng.choice(WORDS)
        else:
            second = _sentence(rng)
        rows["sentence1"].append(" ".join(first))
        rows["sentence2"].append(" ".join(second))
        rows["label"].append(int(label))
        rows["idx"].append(index)
    return rows


def _text_rows(count: int, seed: int, blank_share: float) -> dict[str, list]:
    rng = random.Random(seed)
    return {
        "text": [
            "" if rng.random() < blank_share else " ".join(_sentence(rng)) for _ in range(count)
        ]
    }


def load_dataset(path: str, name: str | None = None, *args, **kwargs):
    """`datasets.load_dataset` for the two data sets the scripts ask for."""
    from datasets import ClassLabel, Dataset, DatasetDict, Features, Value

    if "glue" in path:
        features = Features(
            {
                "sentence1": Value("string"),
                "sentence2": Value("string"),
                "label": ClassLabel(names=["not_equivalent", "equivalent"]),
                "idx": Value("int32"),
            }
        )
        splits = {"train": (96, 1), "validation": (40, 2), "test": (40, 3)}
        return DatasetDict(
            {
                s: Dataset.from_dict(_mrpc_rows(n, seed), features=features)
                for s, (n, seed) in splits.items()
            }
        )
    if "wikitext" in path:
        # The script keeps the first 500 training rows; most are blank, as in wikitext.
        splits = {"train": (500, 4, 0.85), "validation": (24, 5, 0.2), "test": (24, 6, 0.2)}
        return DatasetDict(
            {s: Dataset.from_dict(_text_rows(n, seed, b)) for s, (n, seed, b) in splits.items()}
        )
    raise ValueError(f"offline_hub has no data set {path!r}")


def tokenizer(*args, **kwargs):
    """A word-level tokenizer over WORDS, pairs as `[CLS] a [SEP] b [SEP]` with token types."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        eos_token="</s>",
        model_max_length=MAX_LENGTH,
    )


def _limit_batch(model: torch.nn.Module) -> torch.nn.Module:
    limit = int(os.environ.get("OFFLINE_HUB_MAX_BATCH", "0"))
    if not limit:
        return model

    def check(module, args, kwargs):
        inputs = kwargs.get("input_ids", args[0] if args else None)
        if module.training and inputs is not None and inputs.shape[0] > limit:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate a batch of {inputs.shape[0]} "
                f"(the offline harness allows {limit})."
            )

    model.register_forward_pre_hook(check, with_kwargs=True)
    return model


def sequence_classifier(*args, **kwargs):
    """A 2-layer BERT of width 32 with a 2-class head, initialised from the random state."""
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=len(SPECIAL) + len(WORDS),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=MAX_LENGTH,
        num_labels=2,
        # wide initial weights, so that an untrained model's predictions depend on the input
        initializer_range=0.3,
    )
    return _limit_batch(BertForSequenceClassification(config))


def causal_lm(*args, **kwargs):
    """A 2-layer Llama of width 32, initialised from the random state."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(SPECIAL) + len(WORDS),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=MAX_LENGTH,
    )
    return _limit_batch(LlamaForCausalLM(config))


class GlueMrpcMetric:
    """`evaluate.load("glue", "mrpc")`: accuracy and F1 of the positive class."""

    def __init__(self) -> None:
        self.predictions: list[int] = []
        self.references: list[int] = []

    def add_batch(self, predictions, references) -> None:
        self.predictions += torch.as_tensor(predictions).tolist()
        self.references += torch.as_tensor(references).tolist()

    def compute(self, predictions=None, references=None) -> dict[str, float]:
        from sklearn.metrics import f1_score

        if predictions is not None:
            self.add_batch(predictions, references)
        predictions, references = self.predictions, self.references
        self.predictions, self.references = [], []
        correct = sum(p == r for p, r in zip(predictions, references, strict=True))
        return {
            "accuracy": float(correct / len(references)),
            "f1": float(f1_score(y_true=references, y_pred=predictions)),
        }


def load_metric(path: str, config_name: str | None = None, *args, **kwargs) -> GlueMrpcMetric:
    if path != "glue" or config_name != "mrpc":
        raise ValueError(f"offline_hub has no metric {path!r}/{config_name!r}")
    return GlueMrpcMetric()


class TinyImageClassifier(torch.nn.Module):
    """What the scripts use of a timm model: forward, `default_cfg`, `get_classifier()`."""

    default_cfg = {"mean": (0.485, 0.456, 0.406), "std": (0.229, 0.224, 0.225)}

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, stride=4, padding=1),
            torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(),
        )
        self.fc = torch.nn.Linear(8, num_classes)

    def get_classifier(self) -> torch.nn.Module:
        return self.fc

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(images))


def create_model(name: str, pretrained: bool = False, num_classes: int = 1000, **kwargs):
    """`timm.create_model`: a tiny image classifier from the random state."""
    return TinyImageClassifier(num_classes)


def write_images(folder: Path, per_class: int = 10, size: int = 24) -> Path:
    """JPEG files named like the Oxford pets set (`<breed>_<n>.jpg`), one colour per breed."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(7)
    for k, breed in enumerate(IMAGE_CLASSES):
        for n in range(per_class):
            base = [40 + 80 * ((k + c) % 3) for c in range(3)]
            pixels = bytes(
                max(0, min(255, base[c] + rng.randint(-40, 40)))
                for _ in range(size * size)
                for c in range(3)
            )
            Image.frombytes("RGB", (size, size), pixels).save(folder / f"{breed}_{n}.jpg")
    return folder


def _transforms_module() -> types.ModuleType:
    """torchvision.transforms' Compose, RandomResizedCrop, Resize and ToTensor on PIL images."""
    module = types.ModuleType("torchvision.transforms")

    def _pair(size):
        return tuple(size) if isinstance(size, (list, tuple)) else (size, size)

    class Compose:
        def __init__(self, transforms):
            self.transforms = transforms

        def __call__(self, image):
            for transform in self.transforms:
                image = transform(image)
            return image

    class Resize:
        def __init__(self, size):
            self.size = _pair(size)

        def __call__(self, image):
            return image.resize(self.size[::-1])

    class RandomResizedCrop:
        def __init__(self, size, scale=(0.08, 1.0)):
            self.size, self.scale = _pair(size), scale

        def __call__(self, image):
            width, height = image.size
            share = torch.empty(1).uniform_(*self.scale).item()
            w = max(1, min(width, round(width * share**0.5)))
            h = max(1, min(height, round(height * share**0.5)))
            left = int(torch.randint(0, width - w + 1, (1,)))
            top = int(torch.randint(0, height - h + 1, (1,)))
            return image.crop((left, top, left + w, top + h)).resize(self.size[::-1])

    class ToTensor:
        def __call__(self, image):
            data = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
            width, height = image.size
            return data.view(height, width, 3).permute(2, 0, 1).float().div(255)

    for cls in (Compose, Resize, RandomResizedCrop, ToTensor):
        setattr(module, cls.__name__, cls)
    return module


def _importable(name: str) -> bool:
    try:
        __import__(name)
        return True
    except Exception:  # noqa: BLE001 - a broken install counts as absent
        return False


def install() -> None:
    """Point the scripts' downloads at the stand-ins above (in this process)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets
    import evaluate
    import transformers

    datasets.disable_progress_bars()
    datasets.load_dataset = load_dataset
    evaluate.load = load_metric
    transformers.AutoTokenizer.from_pretrained = tokenizer
    transformers.AutoModelForSequenceClassification.from_pretrained = sequence_classifier
    transformers.AutoModelForCausalLM.from_pretrained = causal_lm
    if _importable("timm"):
        import timm

        timm.create_model = create_model
    else:
        sys.modules["timm"] = types.ModuleType("timm")
        sys.modules["timm"].create_model = create_model
    if not _importable("torchvision.transforms"):
        package = types.ModuleType("torchvision")
        package.transforms = _transforms_module()
        sys.modules["torchvision"] = package
        sys.modules["torchvision.transforms"] = package.transforms
