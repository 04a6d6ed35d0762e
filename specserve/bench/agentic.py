"""The agentic workload: multi-turn tool-use conversations, generated reproducibly from a seed.

No data package on PyPI ships whole tool-use conversations, results included: BFCL's
(`bfcl-eval`) multi-turn cases hold the calls but leave their results to its simulated
back-ends, and the package pins numpy 1.26 among some thirty dependencies. So each
conversation here is one of five agent tasks (a trip, web research, a sales report, a refund,
a code edit) with its values drawn from a seeded generator: the system prompt, the user's
request, then the assistant's tool call and the tool's result, turn after turn, each call
built from what earlier results returned (a flight number from the search, an order id from
the orders, a path from the listing), as real agent traffic repeats keys, schema fragments
and earlier values. The agent offers the task's tools and two others.

Every assistant turn of a conversation is one request: the conversation up to that turn,
with `tools` and tool_choice `required` (the answer is the next call), and the last turn
with a JSON-schema `response_format` (the agent's report, bench/agentic_tools.py).
"""
from __future__ import annotations

import json
import random
from datetime import date, timedelta

from specserve.bench.agentic_tools import REPORT_SCHEMA, TOOLS
from specserve.bench.structured_requests import StructuredRequest

SYSTEM = ("You are an operations agent for Northwind Ltd. Today is {today}. Use the tools to complete the "
          "user's task, one call at a time; when it is complete, answer with a JSON report of what you did.")
CITIES = [("Lisbon", "LIS"), ("Tokyo", "HND"), ("Chicago", "ORD"), ("Nairobi", "NBO"), ("Sydney", "SYD"),
          ("Toronto", "YYZ"), ("Berlin", "BER"), ("Mumbai", "BOM"), ("Seoul", "ICN"), ("Madrid", "MAD"),
          ("Denver", "DEN"), ("Oslo", "OSL")]
CONDITIONS = ["sunny", "partly cloudy", "cloudy", "light rain", "showers", "thunderstorms", "windy"]
AIRLINES = ["BA", "LH", "AF", "UA", "NH", "QF", "AC", "TP", "KL"]
NAMES = ["maria", "james", "aiko", "omar", "chen", "fatima", "lucas", "priya", "noah", "elena", "kwame", "sofia"]
SURNAMES = ["silva", "okafor", "tanaka", "novak", "garcia", "smith", "kim", "haddad", "berg", "rossi"]
TOPICS = ["solid-state battery recycling", "heat pump efficiency in cold climates", "vertical farming costs",
          "open-source vector databases", "EU AI Act obligations for providers", "offshore wind capacity factors",
          "sodium-ion battery startups", "remote work productivity studies"]
SITES = ["example-research.org", "techreview.example.com", "energy.example.net", "policywatch.example.eu"]
REGIONS = ["north", "south", "east", "west", "central"]
PRODUCTS = ["standing desk", "ergonomic chair", "monitor arm", "desk lamp", "cable tray", "footrest", "webcam"]
PACKAGES = ["billing", "auth", "reports", "scheduler", "notifications"]
MODULES = ["client.py", "models.py", "utils.py", "handlers.py", "config.py"]
REASONS = ["damaged", "late", "wrong_item", "not_as_described"]


def email(rng: random.Random) -> str:
    return f"{rng.choice(NAMES)}.{rng.choice(SURNAMES)}@northwind.example.com"


def trip(rng: random.Random, today: date) -> tuple[str, list]:
    (home, origin), (city, destination) = rng.sample(CITIES, 2)
    days, cabin, unit, user = rng.randint(3, 5), rng.choice(["economy", "premium", "business"]), \
        rng.choice(["celsius", "fahrenheit"]), email(rng)
    forecast = [{"date": (today + timedelta(days=d + 1)).isoformat(), "high": rng.randint(8, 31),
                 "low": rng.randint(-2, 7), "condition": rng.choice(CONDITIONS)} for d in range(days)]
    driest = min(forecast, key=lambda day: ("rain" in day["condition"] or "storm" in day["condition"], day["date"]))
    flights = [{"flight": f"{rng.choice(AIRLINES)}{rng.randint(10, 999)}",
                "departs": f"{driest['date']}T{rng.randint(6, 21):02d}:{rng.choice(['00', '15', '30', '45'])}",
                "duration_minutes": rng.randint(90, 780), "stops": rng.randint(0, 1), "price_usd": rng.randint(180, 2400)}
               for _ in range(3)]
    chosen = min(flights, key=lambda flight: (flight["stops"], flight["price_usd"]))
    event = {"title": f"Flight {chosen['flight']} {origin} to {destination}", "start": chosen["departs"],
             "duration_minutes": chosen["duration_minutes"], "location": f"{home} airport ({origin})", "attendees": [user]}
    steps = [("get_weather", {"city": city, "unit": unit, "days": days}, {"city": city, "unit": unit, "forecast": forecast}),
             ("search_flights", {"origin": origin, "destination": destination, "date": driest["date"], "cabin": cabin,
                                 "max_results": 3}, {"flights": flights}),
             ("create_calendar_event", event, {"event_id": f"evt_{rng.getrandbits(40):010x}", "status": "confirmed",
                                               **event})]
    return (f"I'm flying from {home} to {city} in the next {days} days. Check the weather there, find me a {cabin} "
            f"flight on the driest day, and put it in my calendar ({user})."), steps


def research(rng: random.Random, today: date) -> tuple[str, list]:
    topic = rng.choice(TOPICS)
    slug = "-".join(topic.lower().replace(".", "").split()[:4])
    results = [{"title": f"{topic.capitalize()}: {angle}", "url": f"https://{rng.choice(SITES)}/{today.year}/{slug}-{i}",
                "snippet": f"A {today.year} review of {topic}: {angle.lower()}, "
                           f"with figures from {rng.randint(3, 40)} studies."}
               for i, angle in enumerate(rng.sample(["what changed", "costs and trade-offs", "the open questions",
                                                      "who leads", "a field guide"], 3))]
    page = results[0]
    body = f"{page['snippet']} The authors expect {rng.randint(5, 60)}% growth by {today.year + rng.randint(2, 6)}."
    note = f"# {page['title']}\n\n{body}\n\nSource: {page['url']}"
    steps = [("web_search", {"query": f"{topic} {today.year}", "max_results": 3}, {"results": results}),
             ("fetch_page", {"url": page["url"]}, {"url": page["url"], "title": page["title"], "text": body}),
             ("write_file", {"path": f"notes/{slug}.md", "content": note},
              {"path": f"notes/{slug}.md", "bytes_written": len(note.encode())})]
    return f"Research {topic} and save a short note with the best source under notes/.", steps


def sales_report(rng: random.Random, today: date) -> tuple[str, list]:
    month, manager = f"{today.year}-{rng.randint(1, 12):02d}", email(rng)
    by_region = sorted(([region, rng.randint(20, 400) * 100] for region in rng.sample(REGIONS, 4)),
                       key=lambda row: -row[1])
    top, revenue = by_region[0]
    by_product = sorted(([product, rng.randint(5, 90) * 100] for product in rng.sample(PRODUCTS, 3)),
                        key=lambda row: -row[1])
    lines = "; ".join(f"{product} ${amount}" for product, amount in by_product)
    steps = [("run_sql", {"database": "sales", "query": "SELECT region, SUM(amount) AS revenue FROM orders WHERE "
                          f"month = '{month}' GROUP BY region ORDER BY revenue DESC"},
              {"columns": ["region", "revenue"], "rows": by_region, "row_count": len(by_region)}),
             ("run_sql", {"database": "sales", "query": "SELECT product, SUM(amount) AS revenue FROM orders WHERE "
                          f"month = '{month}' AND region = '{top}' GROUP BY product ORDER BY revenue DESC LIMIT 3"},
              {"columns": ["product", "revenue"], "rows": by_product, "row_count": len(by_product)}),
             ("send_email", {"to": [manager], "subject": f"{month} sales: {top} leads with ${revenue}",
                             "body": f"The {top} region led {month} with ${revenue}. Top products there: {lines}."},
              {"message_id": f"msg_{rng.getrandbits(48):012x}", "status": "sent"})]
    return f"Which region sold the most in {month}, and what sold best there? Email the answer to {manager}.", steps


def refund(rng: random.Random, today: date) -> tuple[str, list]:
    user, customer_id = email(rng), f"cus_{rng.getrandbits(40):010x}"[:12]
    orders = [{"order_id": f"ord_{rng.randint(100000, 999999)}",
               "placed": (today - timedelta(days=rng.randint(3, 60))).isoformat(),
               "total": round(rng.uniform(15, 900), 2), "items": rng.sample(PRODUCTS, rng.randint(1, 2))}
              for _ in range(rng.randint(2, 3))]
    order, reason = rng.choice(orders), rng.choice(REASONS)
    order_id, total, complaint = order["order_id"], order["total"], reason.replace("_", " ")
    refund_id = f"re_{rng.getrandbits(40):010x}"
    customer = {"customer_id": customer_id, "name": user.split("@")[0].replace(".", " ").title(),
                "tier": rng.choice(["standard", "plus", "pro"])}
    body = f"We refunded ${total} for your {', '.join(order['items'])} ({complaint}). Reference {refund_id}."
    steps = [("lookup_customer", {"email": user}, customer),
             ("get_orders", {"customer_id": customer_id, "status": "delivered", "limit": 5}, {"orders": orders}),
             ("issue_refund", {"order_id": order_id, "amount": total, "reason": reason},
              {"refund_id": refund_id, "order_id": order_id, "amount": total, "status": "approved"}),
             ("send_email", {"to": [user], "subject": f"Your refund for order {order_id}", "body": body},
              {"message_id": f"msg_{rng.getrandbits(48):012x}", "status": "sent"})]
    items = " and ".join(order["items"])
    return f"Customer {user} says the {items} they got was {complaint}. Refund that order and let them know.", steps


def code_edit(rng: random.Random, today: date) -> tuple[str, list]:
    package, module = rng.choice(PACKAGES), rng.choice(MODULES)
    folder, name = f"src/{package}", rng.choice(["load", "parse", "fetch", "render", "retry"]) + f"_{package}"
    entries = [{"name": m, "type": "file", "size": rng.randint(400, 9000)} for m in rng.sample(MODULES, 3)]
    entries.append({"name": module, "type": "file", "size": rng.randint(400, 9000)})
    source = f"def {name}(path, timeout):\n    with open(path) as f:\n        return f.read()[:timeout]\n"
    edited = f'def {name}(path: str, timeout: int) -> str:\n    """{name.split("_")[0].title()} the {package} file."""\n' \
             "    with open(path) as f:\n        return f.read()[:timeout]\n"
    path = f"{folder}/{module}"
    steps = [("list_directory", {"path": folder, "recursive": False}, {"path": folder, "entries": entries}),
             ("read_file", {"path": path, "max_lines": 80}, {"path": path, "content": source}),
             ("write_file", {"path": path, "content": edited}, {"path": path, "bytes_written": len(edited.encode())})]
    return f"In {folder}, add type hints and a docstring to {name} (it is in {module}).", steps


SCENARIOS = [trip, research, sales_report, refund, code_edit]


def conversation_requests(rng: random.Random, scenario, today: date) -> list[StructuredRequest]:
    """One conversation's requests: each tool call's turn, then the report's."""
    user, steps = scenario(rng, today)
    names = [name for name, _, _ in steps]
    others = rng.sample(sorted(set(TOOLS) - set(names)), 2)
    tools = [TOOLS[name] for name in dict.fromkeys(names + others)]
    rng.shuffle(tools)
    messages = [{"role": "system", "content": SYSTEM.format(today=today.isoformat())}, {"role": "user", "content": user}]
    requests = []
    for name, arguments, result in steps:
        requests.append(StructuredRequest(list(messages), tools, "required"))
        call_id = f"call_{rng.getrandbits(64):016x}"
        call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}
        messages += [{"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": call_id, "content": json.dumps(result)}]
    requests.append(StructuredRequest(messages, tools, "none", REPORT_SCHEMA))
    return requests


def agentic_requests(num: int, seed: int = 1) -> list[StructuredRequest]:
    """`num` requests, conversation after conversation (each one's turns in order), the
    tasks taken in turn; the same seed gives the same requests."""
    rng = random.Random(seed)
    requests: list[StructuredRequest] = []
    index = 0
    while len(requests) < num:
        today = date(2026, 1, 5) + timedelta(days=rng.randint(0, 330))
        requests += conversation_requests(rng, SCENARIOS[index % len(SCENARIOS)], today)
        index += 1
    return requests[:num]
