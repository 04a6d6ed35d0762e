"""OpenAI's `response_format`: free text, any JSON object, or JSON following a schema. The
schema is checked when the body is parsed (a 400 naming response_format) and always
enforced, `strict` or not: the grammar masks every token."""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from specserve.request.grammar_spec import JSON_OBJECT_SCHEMA, GrammarSpec, check_grammar


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")   # `schema` would shadow a BaseModel method
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _check_schema(self):
        if self.type == "json_schema":
            if self.json_schema is None:
                raise ValueError("response_format of type json_schema needs a json_schema object")
            try:
                check_grammar(GrammarSpec("json_schema", self.grammar_params()["json_schema"]))
            except ValueError as error:
                raise ValueError(f"response_format.{error}") from None
        return self

    def grammar_params(self) -> dict[str, str]:
        """The engine's sampling params that enforce it (none for text)."""
        if self.type == "json_object":
            return {"json_schema": JSON_OBJECT_SCHEMA}
        if self.type == "json_schema":
            schema = self.json_schema.schema_
            return {"json_schema": json.dumps(schema) if schema else JSON_OBJECT_SCHEMA}
        return {}
