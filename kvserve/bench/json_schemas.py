"""JSON schemas for the structured-output benchmarks and tests: nested objects, arrays with
minItems / maxItems, enums, anyOf, required and optional fields, numbers with bounds, string
patterns. Each comes with the request a user would write for it."""

from __future__ import annotations

from typing import Any


def _obj(props: dict[str, Any], required: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False, **extra}


_STR = {"type": "string"}
_INT = {"type": "integer"}
_NUM = {"type": "number"}
_BOOL = {"type": "boolean"}

# (name, what to ask for, schema)
SCHEMAS: list[tuple[str, str, dict[str, Any]]] = [
    ("person", "a person with a name and an age", _obj({"name": _STR, "age": {**_INT, "minimum": 0, "maximum": 130}})),
    ("city", "a city, its country and its population",
     _obj({"city": _STR, "country": _STR, "population": {**_INT, "minimum": 0}})),
    ("book", "a book with a title, an author, a year and whether it is fiction",
     _obj({"title": _STR, "author": _STR, "year": {**_INT, "minimum": 1000, "maximum": 2100}, "fiction": _BOOL})),
    ("color", "a favourite colour", _obj({"color": {"enum": ["red", "green", "blue", "yellow", "black", "white"]}})),
    ("sentiment", "the sentiment of the sentence 'I love this phone' with a confidence",
     _obj({"sentiment": {"enum": ["positive", "negative", "neutral"]},
           "confidence": {**_NUM, "minimum": 0, "maximum": 1}})),
    ("tags", "two to four tags for an article about cooking",
     _obj({"tags": {"type": "array", "items": _STR, "minItems": 2, "maxItems": 4}})),
    ("scores", "three test scores between 0 and 100",
     _obj({"scores": {"type": "array", "items": {**_INT, "minimum": 0, "maximum": 100}, "minItems": 3, "maxItems": 3}})),
    ("address", "a postal address",
     _obj({"street": _STR, "city": _STR, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}, "country": _STR})),
    ("nested_user", "a user with a nested address",
     _obj({"name": _STR, "address": _obj({"street": _STR, "city": _STR})})),
    ("order", "an order with a list of items, each with a product and a quantity",
     _obj({"order_id": _INT, "items": {"type": "array", "minItems": 1, "maxItems": 3,
                                       "items": _obj({"product": _STR, "quantity": {**_INT, "minimum": 1}})}})),
    ("optional_fields", "a product; the discount is optional",
     _obj({"name": _STR, "price": {**_NUM, "minimum": 0}, "discount": {**_NUM, "minimum": 0, "maximum": 1}},
          required=["name", "price"])),
    ("any_of_contact", "a contact: either an email or a phone number",
     _obj({"contact": {"anyOf": [_obj({"email": {"type": "string", "pattern": "^[a-z]{1,20}@[a-z]{1,20}\\.com$"}}),
                                 _obj({"phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"}})]}})),
    ("any_of_value", "a setting whose value is a number or a word",
     _obj({"key": _STR, "value": {"anyOf": [_NUM, _STR]}})),
    ("date", "a date as YYYY-MM-DD and a weekday",
     _obj({"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
           "weekday": {"enum": ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"]}})),
    ("point", "a 2D point", _obj({"x": _NUM, "y": _NUM})),
    ("rectangle", "a rectangle from two corner points",
     _obj({"top_left": _obj({"x": _INT, "y": _INT}), "bottom_right": _obj({"x": _INT, "y": _INT})})),
    ("weather", "today's weather",
     _obj({"temperature_c": {**_NUM, "minimum": -60, "maximum": 60},
           "condition": {"enum": ["sunny", "cloudy", "rain", "snow"]}, "wind_kmh": {**_INT, "minimum": 0}})),
    ("movie", "a movie with a title, a year, a genre list and a rating",
     _obj({"title": _STR, "year": _INT, "genres": {"type": "array", "items": _STR, "minItems": 1, "maxItems": 3},
           "rating": {**_NUM, "minimum": 0, "maximum": 10}})),
    ("boolean_flags", "feature flags for an app",
     _obj({"dark_mode": _BOOL, "notifications": _BOOL, "beta": _BOOL})),
    ("employee", "an employee with a role and a manager who has a name",
     _obj({"name": _STR, "role": {"enum": ["engineer", "designer", "manager"]},
           "manager": _obj({"name": _STR}, required=["name"])})),
    ("recipe", "a recipe with ingredients and steps",
     _obj({"name": _STR, "ingredients": {"type": "array", "items": _STR, "minItems": 2, "maxItems": 5},
           "steps": {"type": "array", "items": _STR, "minItems": 1, "maxItems": 4}})),
    ("hex_color", "a colour as a hex code", _obj({"hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}})),
    ("username", "a username of lowercase letters and digits",
     _obj({"username": {"type": "string", "pattern": "^[a-z][a-z0-9]{2,11}$"}})),
    ("matrix", "a 2x2 matrix of integers",
     _obj({"rows": {"type": "array", "minItems": 2, "maxItems": 2,
                    "items": {"type": "array", "items": _INT, "minItems": 2, "maxItems": 2}}})),
    ("event", "a calendar event with attendees",
     _obj({"title": _STR, "start_hour": {**_INT, "minimum": 0, "maximum": 23},
           "attendees": {"type": "array", "items": _obj({"name": _STR, "required": _BOOL}), "maxItems": 3}})),
    ("nullable", "a middle name, which may be null",
     _obj({"first": _STR, "middle": {"anyOf": [_STR, {"type": "null"}]}, "last": _STR})),
    ("invoice", "an invoice with a currency and line totals",
     _obj({"currency": {"enum": ["USD", "EUR", "GBP"]},
           "lines": {"type": "array", "minItems": 1, "maxItems": 3,
                     "items": _obj({"description": _STR, "amount": {**_NUM, "minimum": 0}})},
           "paid": _BOOL})),
    ("tree", "a folder with up to two files and one subfolder",
     _obj({"name": _STR, "files": {"type": "array", "items": _STR, "maxItems": 2},
           "subfolder": _obj({"name": _STR, "files": {"type": "array", "items": _STR, "maxItems": 2}})})),
    ("http_request", "an HTTP request",
     _obj({"method": {"enum": ["GET", "POST", "PUT", "DELETE"]},
           "path": {"type": "string", "pattern": "^/[a-z/]{0,40}$"}, "status": {**_INT, "minimum": 100, "maximum": 599}})),
    ("planet", "a planet of the solar system and its order from the sun",
     _obj({"planet": {"enum": ["Mercury", "Venus", "Earth", "Mars", "Jupiter", "Saturn", "Uranus", "Neptune"]},
           "order": {**_INT, "minimum": 1, "maximum": 8}})),
    ("survey", "survey answers: a 1-5 rating, a yes/no and an optional comment",
     _obj({"rating": {**_INT, "minimum": 1, "maximum": 5}, "recommend": _BOOL, "comment": _STR},
          required=["rating", "recommend"])),
    ("ten_fields", "a detailed profile of a fictional customer",
     _obj({"id": _INT, "first_name": _STR, "last_name": _STR, "email": _STR, "age": {**_INT, "minimum": 18},
           "country": _STR, "vip": _BOOL, "balance": _NUM,
           "plan": {"enum": ["free", "pro", "team"]}, "notes": _STR})),
]


def schema_prompt(what: str, schema: dict[str, Any]) -> list[dict[str, str]]:
    """The chat a user would send: what to produce, and the schema."""
    import json

    return [{"role": "system", "content": "You answer with a single JSON object and nothing else."},
            {"role": "user", "content": f"Give me {what} as JSON following this schema: {json.dumps(schema)}"}]
