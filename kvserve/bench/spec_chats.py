"""Chats for `kvserve bench spec`: input-grounded ones (copy, edit, quote) whose answers
reuse the prompt's text, and unrelated ones whose answers do not."""
from __future__ import annotations

_CODE = '''def load_scores(path):
    scores = {}
    with open(path) as handle:
        for line in handle:
            name, value = line.strip().split(",")
            scores[name] = int(value)
    return scores


def best_player(scores):
    best_name, best_value = None, -1
    for name, value in scores.items():
        if value > best_value:
            best_name, best_value = name, value
    return best_name
'''

_PASSAGE = ("The lighthouse stood on a narrow rock at the mouth of the bay. Every evening the keeper "
            "climbed the one hundred and twelve steps to light the lamp, and every morning he wrote the "
            "weather, the ships he had seen and the state of the sea in a thick leather logbook. In the "
            "winter of 1887 a storm broke the great lens, and for eleven nights the keeper kept a row of "
            "oil lamps burning in its place until a new lens arrived from the mainland.")

_LETTER = ("Dear Ms. Alvarez,\nThank you for your order of three blue ceramic bowls and one large serving "
           "plate. Your parcel was shipped on Monday by express courier and should arrive within four "
           "working days. The tracking number is QX-4471-908. If any item arrives damaged, please reply "
           "to this letter with a photograph and we will send a replacement at no cost.\nKind regards,\n"
           "The Riverside Pottery team")

GROUNDED_CHATS: dict[str, str] = {
    "copy code": f"Copy this code exactly, without any change or comment:\n\n{_CODE}",
    "edit code": ("Rename the function best_player to top_player and the variable scores to results. "
                  f"Output the whole code:\n\n{_CODE}"),
    "quote passage": f"Repeat the following passage word for word:\n\n{_PASSAGE}",
    "edit letter": ("Rewrite this letter with the customer name changed to Mr. Chen. Keep everything "
                    f"else the same:\n\n{_LETTER}"),
}

UNRELATED_CHATS: list[str] = [
    "Write a short poem about autumn leaves.",
    "Explain how a bicycle gear works.",
    "Give three tips for learning a new language.",
    "What is the difference between weather and climate?",
    "Describe a good breakfast in two sentences.",
    "Why is the sky blue?",
    "Suggest a name for a small coffee shop and explain it.",
    "How do plants make food from sunlight?",
]


def as_conversation(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]
