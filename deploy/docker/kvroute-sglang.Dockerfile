# SGLang replica image: SGLang's own CUDA image plus kvroute (for `kvroute launch`, which execs
# `python -m sglang.launch_server` from a deployment profile). Pin the SGLang tag the profile was
# validated against (tests/replica/test_launch.py checks the flags with SGLang 0.5.23's parser).
# Build from the repository root:
#   docker build -f deploy/docker/kvroute-sglang.Dockerfile -t kvroute-sglang:0.1.0 .
ARG SGLANG_IMAGE=lmsysorg/sglang:v0.5.23
FROM ${SGLANG_IMAGE}
COPY pyproject.toml README.md /opt/kvroute/
COPY router /opt/kvroute/router
COPY replica /opt/kvroute/replica
COPY loadtests /opt/kvroute/loadtests
# kvroute's own dependencies are light; never let pip touch the image's torch/CUDA stack.
RUN pip install --no-cache-dir --no-deps /opt/kvroute \
 && pip install --no-cache-dir "aiohttp>=3.10" "redis[hiredis]>=5.0" "mmh3>=4.1" "pyyaml>=6.0" \
      "prometheus-client>=0.20" "pydantic>=2.6" "pydantic-settings>=2.2"
EXPOSE 30000
CMD ["kvroute", "launch", "--profile", "kimi-k2.6-b200-tp4"]
