# pdclient serve: the prefill/decode handoff as an OpenAI-compatible proxy.
#   docker build -t pdclient-serve .
#   docker run -p 8000:8000 -e PDCLIENT_PREFILL_BASE_URL=http://P:8000/v1 \
#       -e PDCLIENT_DECODE_BASE_URL=http://D:8000/v1 pdclient-serve
# Every setting is also an environment variable (pdclient serve --help names each).
# The wheel is built in a first stage, so the image holds no source tree and no build tools.
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml setup.py README.md LICENSE ./
COPY pdclient ./pdclient
COPY server_patch ./server_patch
RUN pip wheel --no-cache-dir --disable-pip-version-check --no-deps --wheel-dir /wheels .

FROM python:3.11-slim
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --disable-pip-version-check "$(ls /wheels/pdclient-*.whl)[serve]" \
    && rm -rf /wheels \
    && useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin pdclient
USER 10001
ENV PYTHONUNBUFFERED=1 \
    PDCLIENT_SERVE_HOST=0.0.0.0 \
    PDCLIENT_SERVE_PORT=8000 \
    PDCLIENT_SERVE_LOG_FORMAT=json
EXPOSE 8000
ENTRYPOINT ["pdclient", "serve"]
