"""Regenerate the bundled benchmarks: `python -m fedpool.pipeline.bundled.make_bundled`. Deterministic (seeded)."""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).parent
SEED = 20261129

# (country as written in a sentence, accepted capital spellings). France, Japan, Italy and Spain are the
# few-shot examples in the prompts and are kept out of the test items.
CAPITALS: list[tuple[str, list[str]]] = [
    ("Germany", ["Berlin"]), ("Russia", ["Moscow"]), ("China", ["Beijing", "Peking"]),
    ("Egypt", ["Cairo"]), ("Greece", ["Athens"]), ("Portugal", ["Lisbon"]), ("Ireland", ["Dublin"]),
    ("Austria", ["Vienna"]), ("Poland", ["Warsaw"]), ("Norway", ["Oslo"]), ("Sweden", ["Stockholm"]),
    ("Finland", ["Helsinki"]), ("Denmark", ["Copenhagen"]), ("Hungary", ["Budapest"]),
    ("the Czech Republic", ["Prague"]), ("Belgium", ["Brussels"]), ("the Netherlands", ["Amsterdam"]),
    ("Switzerland", ["Bern", "Berne"]), ("Turkey", ["Ankara"]), ("Iran", ["Tehran"]), ("Iraq", ["Baghdad"]),
    ("India", ["New Delhi", "Delhi"]), ("Thailand", ["Bangkok"]), ("Vietnam", ["Hanoi"]),
    ("Indonesia", ["Jakarta"]), ("the Philippines", ["Manila"]), ("South Korea", ["Seoul"]),
    ("Kenya", ["Nairobi"]), ("Nigeria", ["Abuja"]), ("Ghana", ["Accra"]), ("Morocco", ["Rabat"]),
    ("Peru", ["Lima"]), ("Chile", ["Santiago"]), ("Argentina", ["Buenos Aires"]),
    ("Colombia", ["Bogotá", "Bogota"]), ("Venezuela", ["Caracas"]), ("Cuba", ["Havana"]),
    ("Canada", ["Ottawa"]), ("Australia", ["Canberra"]), ("Mexico", ["Mexico City"]),
    ("Brazil", ["Brasília", "Brasilia"]), ("Ukraine", ["Kyiv", "Kiev"]), ("Romania", ["Bucharest"]),
    ("Bulgaria", ["Sofia"]), ("Serbia", ["Belgrade"]), ("Croatia", ["Zagreb"]), ("Iceland", ["Reykjavik", "Reykjavík"]),
    ("Lebanon", ["Beirut"]), ("Syria", ["Damascus"]), ("Jordan", ["Amman"]), ("Saudi Arabia", ["Riyadh"]),
    ("Pakistan", ["Islamabad"]), ("Afghanistan", ["Kabul"]), ("Nepal", ["Kathmandu"]),
    ("Bangladesh", ["Dhaka"]), ("Malaysia", ["Kuala Lumpur"]), ("Qatar", ["Doha"]), ("Libya", ["Tripoli"]),
    ("Sudan", ["Khartoum"]), ("Uganda", ["Kampala"]), ("Zimbabwe", ["Harare"]), ("Latvia", ["Riga"]),
    ("Lithuania", ["Vilnius"]), ("Estonia", ["Tallinn"]), ("Slovakia", ["Bratislava"]),
    ("Slovenia", ["Ljubljana"]), ("Albania", ["Tirana"]), ("Ecuador", ["Quito"]), ("Uruguay", ["Montevideo"]),
    ("Jamaica", ["Kingston"]), ("Senegal", ["Dakar"]), ("Tunisia", ["Tunis"]), ("Algeria", ["Algiers"]),
    ("Mongolia", ["Ulaanbaatar", "Ulan Bator"]), ("Cambodia", ["Phnom Penh"]),
]


def make_arith(rng: random.Random, n: int = 60) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    seen: set[tuple[int, int]] = set()
    while len(rows) < n:
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        if (a, b) in seen:
            continue
        seen.add((a, b))
        rows.append({"id": f"arith-{len(rows):03d}", "a": a, "b": b, "answer": str(a + b)})
    return rows


def make_capitals() -> list[dict[str, object]]:
    return [
        {"id": f"cap-{i:03d}", "country": country, "answer": names}
        for i, (country, names) in enumerate(CAPITALS)
    ]


def make_capitals_mc(rng: random.Random, n: int = 60) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    items = rng.sample(CAPITALS, n)
    for i, (country, names) in enumerate(items):
        distractors = rng.sample([c[1][0] for c in CAPITALS if c[1][0] != names[0]], 3)
        options = [names[0], *distractors]
        rng.shuffle(options)
        letter = "ABCD"[options.index(names[0])]
        rows.append(
            {"id": f"capmc-{i:03d}", "country": country, "A": options[0], "B": options[1], "C": options[2],
             "D": options[3], "answer": letter}
        )
    return rows


def write_jsonl(path: Path, rows: list[dict[str, object]]) -> None:
    with path.open("w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")


def main() -> None:
    rng = random.Random(SEED)
    write_jsonl(HERE / "arith.jsonl", make_arith(rng))
    write_jsonl(HERE / "capitals.jsonl", make_capitals())
    write_jsonl(HERE / "capitals_mc.jsonl", make_capitals_mc(rng))


if __name__ == "__main__":
    main()
