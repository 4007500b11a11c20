"""A built-in structured-output task: read a short text, answer with a JSON object.

    text    "Lena Okafor, 41, lives in Lisbon. Lena Okafor bought 7 lamps for $12.50 apiece."
    schema  {"type": "object", "properties": {"age": {"type": "integer", ...}, ...},
             "required": [...], "additionalProperties": false}
    record  {"age": 41, "city": "Lisbon", "quantity": 7}   (one field, e.g. "age", is scored)

Every example is generated from templates and a seed, so the structured-output recipe runs
offline and its data is reproducible. The texts vary the sentence templates, their order and
some filler; each schema asks for a random subset (3 to 6, in random order) of six fields of
different types (strings, integers with bounds, a number, an enum), so the policy must read
the schema rather than memorise one shape. One requested field per example is the scored
answer (`answer_key`, `answer`); the whole ground-truth object is kept as `record`. Scored by
the rewards of `jgrpo.rewards.structured`. It has no tokenizer: it needs a pretrained model.
"""

from __future__ import annotations

import json

import numpy as np

from jgrpo.rewards.structured import STRUCTURED_REWARDS, STRUCTURED_WEIGHTS
from jgrpo.tasks.base import Task

_FIRST_NAMES = [
    "Amara", "Bruno", "Chen", "Dalia", "Emil", "Farah", "Goran", "Hana", "Ivan", "Jonas",
    "Keiko", "Lena", "Mateo", "Nadia", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tariq",
    "Uma", "Viktor", "Wen", "Yara", "Zoltan",
]  # fmt: skip
_LAST_NAMES = [
    "Alvarez", "Berg", "Costa", "Dubois", "Eze", "Fischer", "Gupta", "Haddad", "Ito", "Jensen",
    "Kowalski", "Lindqvist", "Moreau", "Nakamura", "Okafor", "Petrov", "Quispe", "Rossi",
    "Silva", "Tanaka",
]  # fmt: skip
_CITIES = [
    "Lisbon", "Nairobi", "Osaka", "Toronto", "Krakow", "Lima", "Hanoi", "Oslo", "Cairo",
    "Denver", "Porto", "Seoul", "Dublin", "Quito", "Tunis", "Perth",
]  # fmt: skip
_ITEMS = ["notebook", "chair", "lamp", "backpack", "mug", "umbrella", "keyboard", "monitor"]

_PROFILES = [
    "{name} is {age} years old and lives in {city}.",
    "{name}, {age}, lives in {city}.",
    "Based in {city}, {name} is {age} years old.",
    "{name} from {city} turned {age} this year.",
    "Customer record: {name}, aged {age}, resident of {city}.",
    "At {age}, {name} has lived in {city} for a while now.",
]
_ORDERS = [
    "{name} ordered {quantity} {items} at ${price} each.",
    "The order: {quantity} {items}, ${price} per unit, placed by {name}.",
    "{name} bought {quantity} {items} for ${price} apiece.",
    "An order for {quantity} {items} at a unit price of ${price} came from {name}.",
    "Last week {name} paid ${price} per item for {quantity} {items}.",
]
_FILLERS = [
    "The package ships next Tuesday.",
    "Payment was made by card.",
    "This was their second order this year.",
    "Delivery is free for this order.",
    "Customer support confirmed the details by email.",
]

# field -> its JSON schema; every field is also mentioned in every text.
_FIELDS = {
    "name": {"type": "string", "description": "the customer's full name"},
    "age": {"type": "integer", "minimum": 18, "maximum": 90, "description": "age in years"},
    "city": {"type": "string", "description": "the city the customer lives in"},
    "item": {"type": "string", "enum": _ITEMS, "description": "what was ordered (singular)"},
    "quantity": {"type": "integer", "minimum": 1, "description": "how many were ordered"},
    "unit_price": {"type": "number", "minimum": 0, "description": "price of one item in dollars"},
}

SYSTEM_PROMPT = (
    "You extract structured data from text. Reply with a single JSON object that validates "
    "against the given JSON schema, and nothing else."
)


def _example(rng: np.random.Generator, chat: bool) -> dict:
    """One generated example: text, schema, prompt, ground-truth record and scored answer."""

    def pick(options):
        return options[int(rng.integers(len(options)))]

    cents = int(rng.integers(100, 20_000))
    truth = {
        "name": f"{pick(_FIRST_NAMES)} {pick(_LAST_NAMES)}",
        "age": int(rng.integers(18, 91)),
        "city": pick(_CITIES),
        "item": pick(_ITEMS),
        "quantity": int(rng.integers(2, 51)),  # >= 2, so the plural in the text reads right
        "unit_price": cents / 100,
    }
    words = dict(truth, items=truth["item"] + "s", price=f"{cents // 100}.{cents % 100:02d}")
    sentences = [pick(_PROFILES).format(**words), pick(_ORDERS).format(**words)]
    if rng.random() < 0.5:
        sentences.reverse()
    if rng.random() < 0.5:
        sentences.insert(int(rng.integers(len(sentences) + 1)), pick(_FILLERS))
    text = " ".join(sentences)

    names = list(_FIELDS)
    count = int(rng.integers(3, len(names) + 1))
    fields = [names[i] for i in rng.permutation(len(names))[:count]]
    schema = {
        "type": "object",
        "properties": {field: _FIELDS[field] for field in fields},
        "required": fields,
        "additionalProperties": False,
    }
    answer_key = pick(fields)
    request = (
        f"Text: {text}\n\n"
        f"Extract these fields as a JSON object: {', '.join(fields)}.\n"
        f"JSON schema: {json.dumps(schema)}\n"
        "Output only the JSON object."
    )
    if chat:
        prompt = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": request},
        ]
    else:
        prompt = f"{SYSTEM_PROMPT}\n\n{request}\nJSON:"
    return {
        "prompt": prompt,
        "schema": schema,
        "answer_key": answer_key,
        "answer": truth[answer_key],
        "record": {field: truth[field] for field in fields},
    }


def json_extraction_task(
    num_examples: int = 2000, held_out: int = 200, seed: int = 0, chat: bool = True
) -> Task:
    """num_examples distinct generated examples, a function of the seed; held_out of them
    (never trained on, no prompt shared) form the eval split, or with 0 the eval split is the
    training set. chat=True gives [system, user] messages, else one plain-text prompt."""
    if num_examples < 1:
        raise ValueError(f"num_examples must be >= 1, got {num_examples}.")
    if not 0 <= held_out < num_examples:
        raise ValueError(f"held_out must be in [0, {num_examples}), got {held_out}.")
    rng = np.random.default_rng(seed)
    examples: dict[str, dict] = {}  # prompt text -> example: duplicates are drawn again
    for _ in range(100 * num_examples):
        example = _example(rng, chat)
        examples.setdefault(json.dumps(example["prompt"]), example)
        if len(examples) == num_examples:
            break
    if len(examples) < num_examples:
        raise ValueError(f"could not generate {num_examples} distinct examples.")
    drawn = list(examples.values())
    train = drawn[held_out:]
    return Task(
        name="json_extraction",
        train=train,
        eval=drawn[:held_out] if held_out else train,
        reward_fns=dict(STRUCTURED_REWARDS),
        reward_weights=dict(STRUCTURED_WEIGHTS),
        correctness="json_answer_correct",
        tokenizer=None,
    )
