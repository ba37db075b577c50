# kvroute image: gateway (`kvroute serve`), sidecar (`kvroute sidecar`) and emulator (`kvroute emulate`).
# Build from the repository root:  docker build -f deploy/docker/kvroute.Dockerfile -t kvroute:0.1.0 .
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY router ./router
COPY replica ./replica
COPY loadtests ./loadtests
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim
RUN useradd --uid 10001 --create-home kvroute
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
USER 10001
EXPOSE 8000 8081
ENTRYPOINT ["kvroute"]
CMD ["--help"]
