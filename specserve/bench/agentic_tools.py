"""The tool library of the agentic workload (bench/agentic.py): OpenAI function tools with
JSON-schema parameters, of the kinds agents call every day (weather, flights, calendar, web
search, SQL, files, email, a shop's customers and orders), and the schema of the agent's
final report. Strings, arrays and numbers are bounded so a constrained answer ends within a
benchmark's token budget."""
from __future__ import annotations

DATE = {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"}
DATE_TIME = {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}$"}
# patterns bound their own length (xgrammar ignores maxLength beside a pattern)
EMAIL = {"type": "string", "pattern": r"^[a-z0-9._]{1,30}@[a-z0-9.]{1,30}\.[a-z]{2,6}$"}
AIRPORT = {"type": "string", "pattern": "^[A-Z]{3}$"}


def text(max_length: int, description: str | None = None) -> dict:
    schema = {"type": "string", "maxLength": max_length}
    return {**schema, "description": description} if description else schema


def integer(minimum: int, maximum: int) -> dict:
    return {"type": "integer", "minimum": minimum, "maximum": maximum}


def enum(*values: str) -> dict:
    return {"type": "string", "enum": list(values)}


def function_tool(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required, "additionalProperties": False}}}


TOOLS = {tool["function"]["name"]: tool for tool in [
    function_tool("get_weather", "Daily weather forecast for a city.", {
        "city": text(40, "City name, e.g. Lisbon"), "unit": enum("celsius", "fahrenheit"), "days": integer(1, 7)},
        ["city"]),
    function_tool("search_flights", "Search direct and one-stop flights between two airports on a date.", {
        "origin": AIRPORT, "destination": AIRPORT, "date": DATE, "cabin": enum("economy", "premium", "business"),
        "max_results": integer(1, 5)}, ["origin", "destination", "date"]),
    function_tool("create_calendar_event", "Add an event to the user's calendar.", {
        "title": text(80), "start": DATE_TIME, "duration_minutes": integer(5, 1440), "location": text(60),
        "attendees": {"type": "array", "items": EMAIL, "maxItems": 4}}, ["title", "start", "duration_minutes"]),
    function_tool("web_search", "Search the web; returns titles, URLs and snippets.", {
        "query": text(100), "max_results": integer(1, 10)}, ["query"]),
    function_tool("fetch_page", "Fetch a web page and return its main text.", {
        "url": {"type": "string", "pattern": "^https://[a-z0-9./_-]{1,110}$"}}, ["url"]),
    function_tool("run_sql", "Run a read-only SQL query against one of the company databases.", {
        "database": enum("sales", "inventory", "support"), "query": text(300)}, ["database", "query"]),
    function_tool("list_directory", "List the files and folders under a path of the repository.", {
        "path": text(100), "recursive": {"type": "boolean"}}, ["path"]),
    function_tool("read_file", "Read a text file of the repository.", {
        "path": text(120), "start_line": integer(1, 10000), "max_lines": integer(1, 400)}, ["path"]),
    function_tool("write_file", "Create or overwrite a text file of the repository.", {
        "path": text(120), "content": text(400)}, ["path", "content"]),
    function_tool("send_email", "Send an email from the user's account.", {
        "to": {"type": "array", "items": EMAIL, "minItems": 1, "maxItems": 3}, "subject": text(100),
        "body": text(300)}, ["to", "subject", "body"]),
    function_tool("lookup_customer", "Find a customer of the shop by email address.", {"email": EMAIL}, ["email"]),
    function_tool("get_orders", "A customer's orders, newest first.", {
        "customer_id": {"type": "string", "pattern": "^cus_[0-9a-z]{8}$"},
        "status": enum("any", "pending", "shipped", "delivered", "returned"), "limit": integer(1, 20)},
        ["customer_id"]),
    function_tool("issue_refund", "Refund all or part of an order.", {
        "order_id": {"type": "string", "pattern": "^ord_[0-9]{6}$"},
        "amount": {"type": "number", "minimum": 0, "maximum": 10000},
        "reason": enum("damaged", "late", "wrong_item", "not_as_described", "other"), "note": text(120)},
        ["order_id", "amount", "reason"]),
]}

# the agent's last turn: a report of what it did, as JSON (response_format json_schema)
REPORT_SCHEMA = {"type": "object", "properties": {
    "status": enum("done", "partial", "failed"), "summary": text(200),
    "references": {"type": "array", "items": text(60), "maxItems": 4}},
    "required": ["status", "summary", "references"], "additionalProperties": False}
