"""``POST /v1/images/generations`` and ``POST /v1/images/edits`` (OpenAI Images API).

``response_format: b64_json`` inlines the PNG; ``url`` points at ``GET /v1/outputs/<sha256>.png``, which
serves the content-addressed file (the same file the run store keeps); with an API key set the URL is signed
(studio/api/signing.py) so a plain GET works without the key until it expires.
"""

from __future__ import annotations

import base64
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from engine import GenerationRequest
from engine.modality import OutputModality
from studio.api.errors import APIError
from studio.api.inputs import check_generation_limits, check_text, params_from_fields, parse_size
from studio.api.protocol import ImageGenerationRequest, now
from studio.api.serving_base import OpenAIServing, reply_headers
from studio.media.images import png_bytes


class OpenAIServingImages(OpenAIServing):
    async def generate(
        self,
        request: ImageGenerationRequest,
        payload: dict[str, Any],
        raw: Request | None,
        image=None,
    ) -> JSONResponse:
        self.check_model(request.model)
        fields: dict[str, Any] = request.model_dump(
            include={
                "seed",
                "num_inference_steps",
                "guidance_scale",
                "negative_prompt",
                "height",
                "width",
                "n",
            },
            exclude_none=True,
        )
        parse_size(request.size, fields)
        check_text(request.prompt, "prompt", self.context.limits)
        check_generation_limits(fields, self.context.limits)
        engine_request = GenerationRequest(
            request.prompt, params_from_fields(fields), image=image, modalities=(OutputModality.IMAGE,)
        )
        resolved, tracker = self.start_run(engine_request, payload)
        result = await self.run_to_completion(resolved, tracker, raw)
        data = []
        for image_out in result.images:
            if request.response_format == "url":
                kept = self.runs.keep_image(image_out)  # the run store's file: one copy per hash
                if kept is None:
                    raise APIError(
                        400, "response_format 'url' needs a data dir; use b64_json", "response_format"
                    )
                sha = kept[0]
                base = str(raw.base_url).rstrip("/") if raw is not None else ""
                make_url = self.context.output_url
                url = make_url(base, sha) if make_url is not None else f"{base}/v1/outputs/{sha}.png"
                data.append({"url": url, "revised_prompt": None})
            else:
                encoded = png_bytes(image_out)
                data.append({"b64_json": base64.b64encode(encoded).decode(), "revised_prompt": None})
        body: dict[str, Any] = {"created": now(), "data": data, "output_format": "png"}
        if self.system_fingerprint is not None:
            body["system_fingerprint"] = self.system_fingerprint
        if resolved.warnings:
            body["warnings"] = list(resolved.warnings)
        return JSONResponse(body, headers=reply_headers(resolved, tracker))
