"""The schema-extraction workload: a record written as free text (an invoice email, a contact's
introduction, a shop's product listing) to extract as JSON of a given schema, sent with a
JSON-schema `response_format`. Records are drawn from a seeded generator and worded by one
of several templates, so the same seed gives the same requests (extraction_records: each with
its right answer); the answer copies names, numbers and dates from the prompt into the
schema's keys (what n-gram drafts predict)."""
from __future__ import annotations

import json
import random
from datetime import date, timedelta

from specserve.bench.agentic import CITIES, NAMES, PRODUCTS, SURNAMES
from specserve.bench.agentic_tools import DATE, EMAIL, enum, integer, text
from specserve.bench.structured_requests import StructuredRequest

MONEY = {"type": "number", "minimum": 0, "maximum": 100000}
COMPANIES = ["Acme Tools", "Blue Fjord Logistics", "Kestrel Analytics", "Orchard Foods", "Lumen Print Co",
             "Harbor & Vine", "Quarry Digital", "Tidewater Supply"]
TITLES = ["data engineer", "head of procurement", "product designer", "site reliability engineer", "account manager"]
SKILLS = ["python", "sql", "negotiation", "figma", "kubernetes", "forecasting", "spanish", "public speaking"]
BRANDS = ["Ergoline", "Deskwise", "Brightnest", "Northforge", "Calmwork"]
FEATURES = ["height memory presets", "bamboo top", "cable management", "anti-collision sensor", "USB-C charging",
            "five-year warranty", "tool-free assembly", "dimmable LED"]

SCHEMAS = {
    "invoice": {"type": "object", "properties": {
        "invoice_number": {"type": "string", "pattern": "^INV-[0-9]{5}$"}, "issue_date": DATE, "due_date": DATE,
        "vendor": text(40), "customer": text(40), "currency": enum("USD", "EUR", "GBP"),
        "line_items": {"type": "array", "minItems": 1, "maxItems": 2, "items": {"type": "object", "properties": {
            "description": text(40), "quantity": integer(1, 500), "unit_price": MONEY},
            "required": ["description", "quantity", "unit_price"], "additionalProperties": False}},
        "total": MONEY}, "required": ["invoice_number", "issue_date", "due_date", "vendor", "customer", "currency",
                                      "line_items", "total"], "additionalProperties": False},
    "contact": {"type": "object", "properties": {
        "name": text(40), "email": EMAIL, "phone": {"type": "string", "pattern": r"^\+[0-9 ]{8,16}$"},
        "company": text(40), "title": text(40), "city": text(30),
        "skills": {"type": "array", "items": text(20), "maxItems": 4}},
        "required": ["name", "email", "company", "title", "city", "skills"], "additionalProperties": False},
    "product": {"type": "object", "properties": {
        "name": text(60), "brand": text(30), "price": MONEY, "currency": enum("USD", "EUR", "GBP"),
        "in_stock": {"type": "boolean"}, "rating": {"type": "number", "minimum": 0, "maximum": 5},
        "features": {"type": "array", "items": text(40), "maxItems": 4},
        "weight_kg": {"type": "number", "minimum": 0, "maximum": 200}},
        "required": ["name", "brand", "price", "currency", "in_stock", "features"], "additionalProperties": False},
}


def invoice(rng: random.Random) -> tuple[str, dict]:
    issued = date(2026, 1, 1) + timedelta(days=rng.randint(0, 300))
    items = [(product, rng.randint(1, 40), round(rng.uniform(5, 600), 2))
             for product in rng.sample(PRODUCTS, rng.randint(1, 2))]
    total = round(sum(quantity * price for _, quantity, price in items), 2)
    currency = rng.choice(["USD", "EUR", "GBP"])
    vendor, customer = rng.sample(COMPANIES, 2)
    number = f"INV-{rng.randint(10000, 99999)}"
    due = issued + timedelta(days=rng.choice([14, 30, 45]))
    lines = "\n".join(f"- {quantity} x {product} at {price:.2f} {currency} each" for product, quantity, price in items)
    answer = {"invoice_number": number, "issue_date": issued.isoformat(), "due_date": due.isoformat(),
              "vendor": vendor, "customer": customer, "currency": currency,
              "line_items": [{"description": product, "quantity": quantity, "unit_price": price}
                             for product, quantity, price in items], "total": total}
    return (f"Hi team,\n\nplease find below invoice {number} from {vendor} to {customer}, issued "
            f"{issued.isoformat()} and due {due.isoformat()}.\n\n"
            f"{lines}\n\nTotal due: {total:.2f} {currency}.\n\nBest regards,\n{vendor} accounts"), answer


def contact(rng: random.Random) -> tuple[str, dict]:
    first, last = rng.choice(NAMES).title(), rng.choice(SURNAMES).title()
    company, title, (city, _) = rng.choice(COMPANIES), rng.choice(TITLES), rng.choice(CITIES)
    skills = rng.sample(SKILLS, rng.randint(1, 4))
    phone = f"+{rng.randint(1, 99)} {rng.randint(100, 999)} {rng.randint(1000, 9999)}"
    email = f"{first.lower()}.{last.lower()}@{company.split()[0].lower()}.example.com"
    answer = {"name": f"{first} {last}", "email": email, "phone": phone, "company": company, "title": title,
              "city": city, "skills": skills}
    return (f"Let me introduce {first} {last}, our new {title} at {company}, based in {city}. {first} works with "
            f"{', '.join(skills)}. You can reach {first} at {email} or on {phone}."), answer


def product(rng: random.Random) -> tuple[str, dict]:
    brand, kind = rng.choice(BRANDS), rng.choice(PRODUCTS)
    name = f"{brand} {kind.title()} {rng.choice(['Pro', 'Lite', 'Max', 'S2', 'Air'])}"
    features = rng.sample(FEATURES, rng.randint(2, 4))
    in_stock = rng.choice([True, False])
    currency, price = rng.choice(['USD', 'EUR', 'GBP']), rng.randint(20, 900) + 0.99
    rating, buyers, weight = rng.randint(30, 50) / 10, rng.randint(5, 3000), rng.randint(10, 400) / 10
    answer = {"name": name, "brand": brand, "price": price, "currency": currency, "in_stock": in_stock,
              "rating": rating, "features": features, "weight_kg": weight}
    stock = "In stock, ships tomorrow." if in_stock else "Currently out of stock."
    return (f"{name} by {brand}. {currency} {price:.2f}. Rated {rating} out of 5 by {buyers} buyers. "
            f"Features: {'; '.join(features)}. Weight {weight} kg. {stock}"), answer


RECORDS = {"invoice": invoice, "contact": contact, "product": product}


def extraction_request(kind: str, record_text: str) -> StructuredRequest:
    schema = SCHEMAS[kind]
    system = (f"Extract the {kind} described by the user as JSON matching this schema, using only facts from the "
              f"text:\n{json.dumps(schema)}")
    return StructuredRequest([{"role": "system", "content": system}, {"role": "user", "content": record_text}],
                             json_schema=schema)


def extraction_requests(num: int, seed: int = 1) -> list[StructuredRequest]:
    """`num` requests, the record kinds in turn; the same seed gives the same requests."""
    return [request for request, _ in extraction_records(num, seed)]


def extraction_records(num: int, seed: int = 1) -> list[tuple[StructuredRequest, dict]]:
    """extraction_requests' requests, each with its right answer: the record as JSON of its schema."""
    rng = random.Random(seed)
    kinds = list(RECORDS)
    records = []
    for i in range(num):
        record_text, answer = RECORDS[kinds[i % len(kinds)]](rng)
        records.append((extraction_request(kinds[i % len(kinds)], record_text), answer))
    return records
