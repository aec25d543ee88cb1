"""The project's own tool-call suite: functions with JSON-schema parameters and prompts that call
them, each with the call a correct reply makes (for exact-match) among 1-4 offered functions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def _fn(name: str, description: str, props: dict[str, Any], required: list[str]) -> dict[str, Any]:
    params = {"type": "object", "properties": props, "required": required, "additionalProperties": False}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": params}}


S = {"type": "string"}
INT = {"type": "integer"}
N = {"type": "number"}

FUNCTIONS: dict[str, dict[str, Any]] = {
    f["function"]["name"]: f
    for f in [
        _fn(
            "get_weather",
            "Current weather for a city",
            {"location": S, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            ["location"],
        ),
        _fn(
            "search_web",
            "Search the web",
            {"query": S, "max_results": {**INT, "minimum": 1, "maximum": 20}},
            ["query"],
        ),
        _fn("send_email", "Send an email", {"to": S, "subject": S, "body": S}, ["to", "subject", "body"]),
        _fn(
            "create_event",
            "Add an event to the calendar",
            {"title": S, "date": {**S, "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}, "duration_minutes": INT},
            ["title", "date"],
        ),
        _fn(
            "convert_currency",
            "Convert money",
            {"amount": N, "from_currency": S, "to_currency": S},
            ["amount", "from_currency", "to_currency"],
        ),
        _fn("get_stock_price", "Latest price of a stock", {"symbol": S}, ["symbol"]),
        _fn(
            "set_timer",
            "Start a countdown timer",
            {"minutes": {**INT, "minimum": 1}, "label": S},
            ["minutes"],
        ),
        _fn("translate", "Translate text", {"text": S, "target_language": S}, ["text", "target_language"]),
        _fn("calculate", "Evaluate an arithmetic expression", {"expression": S}, ["expression"]),
        _fn(
            "book_flight",
            "Book a flight",
            {"origin": S, "destination": S, "date": S},
            ["origin", "destination", "date"],
        ),
        _fn(
            "find_restaurant",
            "Find a restaurant",
            {
                "city": S,
                "cuisine": S,
                "price": {"type": "string", "enum": ["cheap", "moderate", "expensive"]},
            },
            ["city", "cuisine"],
        ),
        _fn("get_time", "Current time in a time zone", {"timezone": S}, ["timezone"]),
    ]
}


@dataclass(frozen=True)
class ToolCase:
    prompt: str
    tools: tuple[str, ...]  # names of the offered functions, in order
    name: str  # the function a correct reply calls
    arguments: dict[str, Any]  # the arguments it gives (exact-match compares these keys)

    def tool_dicts(self) -> list[dict[str, Any]]:
        return [FUNCTIONS[n] for n in self.tools]


def _c(prompt: str, tools: str, name: str, **arguments: Any) -> ToolCase:
    return ToolCase(prompt, tuple(tools.split()), name, arguments)


CASES: list[ToolCase] = [
    _c("What's the weather in Paris?", "get_weather", "get_weather", location="Paris"),
    _c(
        "Is it cold in Oslo right now? Answer in celsius.",
        "get_weather get_time",
        "get_weather",
        location="Oslo",
        unit="celsius",
    ),
    _c(
        "Weather for Tokyo in fahrenheit, please.",
        "search_web get_weather",
        "get_weather",
        location="Tokyo",
        unit="fahrenheit",
    ),
    _c(
        "How warm is it in Cairo today?",
        "get_weather get_stock_price calculate",
        "get_weather",
        location="Cairo",
    ),
    _c(
        "Search the web for the tallest building in the world.",
        "search_web",
        "search_web",
        query="tallest building in the world",
    ),
    _c(
        "Find 5 articles about electric cars.",
        "search_web get_weather",
        "search_web",
        query="electric cars",
        max_results=5,
    ),
    _c(
        "Look up recipes for banana bread.",
        "translate search_web",
        "search_web",
        query="banana bread recipes",
    ),
    _c(
        "Search for news about the Mars rover, 3 results.",
        "search_web get_time send_email",
        "search_web",
        query="Mars rover",
        max_results=3,
    ),
    _c(
        "Email bob@example.com with subject 'Lunch' and say 'See you at noon'.",
        "send_email",
        "send_email",
        to="bob@example.com",
        subject="Lunch",
        body="See you at noon",
    ),
    _c(
        "Send an email to alice@example.org titled 'Report' saying 'The report is ready'.",
        "send_email create_event",
        "send_email",
        to="alice@example.org",
        subject="Report",
        body="The report is ready",
    ),
    _c(
        "Write to team@example.com, subject Meeting, body: Meeting moved to 3pm.",
        "calculate send_email get_time",
        "send_email",
        to="team@example.com",
        subject="Meeting",
        body="Meeting moved to 3pm.",
    ),
    _c(
        "Put 'Dentist' on my calendar for 2026-12-05.",
        "create_event",
        "create_event",
        title="Dentist",
        date="2026-12-05",
    ),
    _c(
        "Schedule a 30 minute 'Team sync' on 2026-12-10.",
        "create_event send_email",
        "create_event",
        title="Team sync",
        date="2026-12-10",
        duration_minutes=30,
    ),
    _c(
        "Add 'Birthday party' on 2027-01-15 to my calendar.",
        "get_time create_event set_timer",
        "create_event",
        title="Birthday party",
        date="2027-01-15",
    ),
    _c(
        "Block 60 minutes for 'Gym' on 2026-12-03.",
        "create_event set_timer get_weather search_web",
        "create_event",
        title="Gym",
        date="2026-12-03",
        duration_minutes=60,
    ),
    _c(
        "Convert 100 USD to EUR.",
        "convert_currency",
        "convert_currency",
        amount=100,
        from_currency="USD",
        to_currency="EUR",
    ),
    _c(
        "How many yen is 50 euros? Use EUR and JPY.",
        "convert_currency calculate",
        "convert_currency",
        amount=50,
        from_currency="EUR",
        to_currency="JPY",
    ),
    _c(
        "Change 20.5 GBP into USD.",
        "get_stock_price convert_currency",
        "convert_currency",
        amount=20.5,
        from_currency="GBP",
        to_currency="USD",
    ),
    _c(
        "Convert 1000 CHF to CAD for me.",
        "search_web convert_currency get_weather",
        "convert_currency",
        amount=1000,
        from_currency="CHF",
        to_currency="CAD",
    ),
    _c(
        "What is Apple's stock price? The symbol is AAPL.",
        "get_stock_price",
        "get_stock_price",
        symbol="AAPL",
    ),
    _c("Price of MSFT right now?", "get_stock_price search_web", "get_stock_price", symbol="MSFT"),
    _c(
        "Check the stock price of NVDA.",
        "convert_currency get_stock_price get_time",
        "get_stock_price",
        symbol="NVDA",
    ),
    _c("Set a timer for 10 minutes.", "set_timer", "set_timer", minutes=10),
    _c("Start a 5 minute timer labelled 'tea'.", "set_timer get_time", "set_timer", minutes=5, label="tea"),
    _c(
        "Timer: 25 minutes, label it 'focus'.",
        "calculate set_timer create_event",
        "set_timer",
        minutes=25,
        label="focus",
    ),
    _c(
        "Remind me in 3 minutes with a timer.",
        "send_email set_timer get_weather translate",
        "set_timer",
        minutes=3,
    ),
    _c(
        "Translate 'good morning' into Spanish.",
        "translate",
        "translate",
        text="good morning",
        target_language="Spanish",
    ),
    _c(
        "How do you say 'thank you' in Japanese?",
        "translate search_web",
        "translate",
        text="thank you",
        target_language="Japanese",
    ),
    _c(
        "Translate 'where is the station' to German.",
        "get_time translate calculate",
        "translate",
        text="where is the station",
        target_language="German",
    ),
    _c(
        "Translate 'I love books' into French.",
        "translate send_email search_web get_weather",
        "translate",
        text="I love books",
        target_language="French",
    ),
    _c("What is 17 * 23?", "calculate", "calculate", expression="17 * 23"),
    _c("Compute 2 + 2.", "calculate convert_currency", "calculate", expression="2 + 2"),
    _c(
        "Calculate (15 - 3) / 4.",
        "get_stock_price calculate search_web",
        "calculate",
        expression="(15 - 3) / 4",
    ),
    _c(
        "Book a flight from London to New York on 2026-12-20.",
        "book_flight",
        "book_flight",
        origin="London",
        destination="New York",
        date="2026-12-20",
    ),
    _c(
        "I need a flight Berlin to Rome, 2027-02-01.",
        "book_flight get_weather",
        "book_flight",
        origin="Berlin",
        destination="Rome",
        date="2027-02-01",
    ),
    _c(
        "Fly me from Madrid to Lisbon on 2026-12-24.",
        "convert_currency book_flight create_event",
        "book_flight",
        origin="Madrid",
        destination="Lisbon",
        date="2026-12-24",
    ),
    _c(
        "Find a cheap Italian restaurant in Boston.",
        "find_restaurant",
        "find_restaurant",
        city="Boston",
        cuisine="Italian",
        price="cheap",
    ),
    _c(
        "Any good sushi places in Seattle?",
        "find_restaurant search_web",
        "find_restaurant",
        city="Seattle",
        cuisine="sushi",
    ),
    _c(
        "Find an expensive French restaurant in Chicago.",
        "get_weather find_restaurant book_flight",
        "find_restaurant",
        city="Chicago",
        cuisine="French",
        price="expensive",
    ),
    _c(
        "Where can I eat moderate Thai food in Denver?",
        "find_restaurant translate get_time set_timer",
        "find_restaurant",
        city="Denver",
        cuisine="Thai",
        price="moderate",
    ),
    _c("What time is it in Asia/Tokyo?", "get_time", "get_time", timezone="Asia/Tokyo"),
    _c("Current time in Europe/London?", "get_time get_weather", "get_time", timezone="Europe/London"),
    _c(
        "Tell me the time in America/New_York.",
        "set_timer get_time calculate",
        "get_time",
        timezone="America/New_York",
    ),
    _c(
        "What's the local time in Australia/Sydney?",
        "search_web translate get_time book_flight",
        "get_time",
        timezone="Australia/Sydney",
    ),
]


def exact_match(case: ToolCase, name: str, arguments: dict[str, Any]) -> bool:
    """The call names the expected function with the expected arguments (strings compared
    case-insensitively, numbers by value); extra optional arguments are allowed."""
    if name != case.name:
        return False
    for key, want in case.arguments.items():
        got = arguments.get(key)
        if isinstance(want, str):
            if not isinstance(got, str) or got.strip().lower() != want.lower():
                return False
        elif isinstance(want, int | float) and not isinstance(want, bool):
            if not isinstance(got, int | float) or isinstance(got, bool) or float(got) != float(want):
                return False
        elif got != want:
            return False
    return True
