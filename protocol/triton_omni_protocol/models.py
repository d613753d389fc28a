"""Every model's inputs and outputs.

Adding an optional input to a stage is one line in its table here, plus the
code that uses the value (see ARCHITECTURE.md). The server completes each
model's config from these tables and decodes requests with them; the client
builds its input tensors from them; a test renders the repository's and
the ensemble's configs against them.
"""

from __future__ import annotations

from dataclasses import replace

from triton_omni_protocol.tensors import EMBEDS_TYPES, TensorSpec

# -- ar (decoupled): Triton's vLLM backend's inputs, then one tensor per common
# sampling option with the names TensorRT-LLM models use, so that clients
# written for either drive it unchanged.
RETURN_FLAGS = ("finish_reason", "cumulative_logprob", "logprobs", "num_input_tokens", "num_output_tokens",
                "token_ids", "heard_states", "thinker_states")
AR_GENERATE_INPUTS = [
    TensorSpec("text_input", "TYPE_STRING", optional=False),
    TensorSpec("stream", "TYPE_BOOL"),
    TensorSpec("sampling_parameters", "TYPE_STRING"),
    TensorSpec("exclude_input_in_output", "TYPE_BOOL"),
    *(TensorSpec(f"return_{name}", "TYPE_BOOL") for name in RETURN_FLAGS),
    TensorSpec("max_tokens", "TYPE_INT32"),
    TensorSpec("min_tokens", "TYPE_INT32"),
    TensorSpec("min_length", "TYPE_INT32"),
    TensorSpec("temperature", "TYPE_FP32"),
    TensorSpec("top_p", "TYPE_FP32"),
    TensorSpec("top_k", "TYPE_INT32"),
    TensorSpec("min_p", "TYPE_FP32"),
    TensorSpec("seed", "TYPE_INT64"),
    TensorSpec("stop", "TYPE_STRING", dims=(-1,), kind="list"),
    TensorSpec("stop_words", "TYPE_STRING", dims=(-1,), kind="list"),
    TensorSpec("frequency_penalty", "TYPE_FP32"),
    TensorSpec("presence_penalty", "TYPE_FP32"),
    TensorSpec("repetition_penalty", "TYPE_FP32"),
    # a LoRA adapter the model serves (its lora_adapters parameter); Triton's vLLM backend's clients
    # name it `lora_name` in sampling_parameters, which is read too
    TensorSpec("lora", "TYPE_STRING"),
    # audio files (WAV, MP3, FLAC, ...) a thinker hears, one per audio marker in the prompt (a Qwen3-Omni
    # model's; docs/models.md, "Input audio")
    TensorSpec("input_audio", "TYPE_STRING", dims=(-1,), kind="blobs"),
    # image files (PNG, JPEG, WebP) a thinker sees, one per image marker in the prompt (a Qwen-Omni
    # thinker on the transformers engine; docs/models.md, "Thinker input images")
    TensorSpec("images", "TYPE_STRING", dims=(-1,), kind="blobs"),
]
# One entry per completion (`n`), as in Triton's vLLM backend; all but
# text_output are sent only when the matching return_* input is true.
AR_GENERATE_OUTPUTS = [
    TensorSpec("text_output", "TYPE_STRING", dims=(-1,)),
    TensorSpec("finish_reason", "TYPE_STRING", dims=(-1,)),
    TensorSpec("cumulative_logprob", "TYPE_FP32", dims=(-1,)),
    TensorSpec("logprobs", "TYPE_STRING", dims=(-1,)),
    TensorSpec("num_input_tokens", "TYPE_UINT32", dims=(1,)),
    TensorSpec("num_output_tokens", "TYPE_UINT32", dims=(-1,)),
    # the new tokens' ids, the completions' one after another (num_output_tokens says how many each):
    # what the speech stage reads of a thinker's reply
    TensorSpec("token_ids", "TYPE_INT64", dims=(-1,)),
    # return_heard_states, on the first response: the prompt's token ids as the thinker read them (its
    # audio and image markers widened to their clips' and images' tokens), and its states at the audio
    # and images, of the layer its talker reads ([tokens, hidden]): what the speech stage needs to speak
    # a reply to audio or images
    TensorSpec("prompt_token_ids", "TYPE_INT64", dims=(-1,)),
    TensorSpec("heard_states", "TYPE_FP32", dims=(-1, -1)),
    # with prompt_token_ids, where the prompt has images: its multimodal rotary positions ([3, prompt
    # tokens]: time, rows, columns), which a talker numbers its own prompt from
    TensorSpec("prompt_positions", "TYPE_INT64", dims=(3, -1)),
    # return_thinker_states (the transformers engine): on each response, the states of the positions the
    # model read since the one before (the prompt's on the first, with prompt_token_ids; then each
    # token fed back), each its layer 0's input plus its last layer's output ([positions, hidden]):
    # what a Qwen2.5-Omni talker reads of its thinker at every prompt and reply token
    TensorSpec("thinker_states", "TYPE_FP32", dims=(-1, -1)),
]

# -- ar_encoder (dynamic batching): a prompt and, optionally, its negative prompt. The negative
# side's outputs come back when `negative_prompt` is given or they are asked for; for an absent
# negative prompt they hold what the family's pipeline uses then (the encoding of "", or zero
# tokens: no negative), which is how text_to_image tells absent from "" (docs/pipelines.md).
AR_ENCODE_INPUTS = [TensorSpec("text_input", "TYPE_STRING", optional=False),
                    TensorSpec("negative_prompt", "TYPE_STRING"),
                    # input image files, read with the prompt where the family's text encoder reads
                    # them (Qwen-Image-Edit's vision tower); ignored otherwise (they are the DiT's)
                    TensorSpec("images", "TYPE_STRING", dims=(-1,), kind="blobs"),
                    # a LoRA adapter of the text encoder (its lora_adapters parameter), for both sides
                    TensorSpec("lora", "TYPE_STRING")]


def ar_encode_outputs(embeds_dtype: str) -> list[TensorSpec]:
    if embeds_dtype not in EMBEDS_TYPES:
        raise ValueError(f"model parameter 'embeds_dtype' must be one of {sorted(EMBEDS_TYPES)}, got {embeds_dtype!r}")
    return [
        TensorSpec("prompt_embeds", EMBEDS_TYPES[embeds_dtype], dims=(-1, -1)),
        TensorSpec("prompt_embeds_mask", "TYPE_INT32", dims=(-1,)),
        TensorSpec("negative_prompt_embeds", EMBEDS_TYPES[embeds_dtype], dims=(-1, -1)),
        TensorSpec("negative_prompt_embeds_mask", "TYPE_INT32", dims=(-1,)),
        # the prompt's pooled embedding where the family's DiT reads one (FLUX.1's CLIP vector), else [0]
        TensorSpec("pooled_prompt_embeds", EMBEDS_TYPES[embeds_dtype], dims=(-1,)),
    ]


# -- the diffusion options: one table. A request's option for the diffusion stage, scalar, optional,
# and validated by the stage (its request dataclass names it; its bounds and defaults are the model's:
# its `limits` and `defaults` parameters, its family's pipeline): `diffusion` takes each as an input,
# and so do `text_to_image` (tests/unit/test_architecture.py holds its config to this table) and
# `omni` (its scheduler converts each to this type and passes it on); the gateway's bodies and
# forms and the CLI's flags (`--name-with-dashes`, documented by `doc`) follow it too. A new option
# is one line here, the ensemble's two lines, and the code that reads it.
DIFFUSION_OPTIONS = [
    TensorSpec("negative_prompt", "TYPE_STRING", doc="what the output should not show (the pipeline's default "
               "unless given)"),
    TensorSpec("num_inference_steps", "TYPE_INT32", doc="denoising steps (default: the model's)"),
    TensorSpec("guidance_scale", "TYPE_FP32", doc="classifier-free guidance scale, or a guidance-distilled "
               "model's guidance input (default: the model's)"),
    TensorSpec("guidance_scale_2", "TYPE_FP32", doc="the low-noise expert's guidance scale, for a model with two "
               "experts (default: guidance_scale)"),
    TensorSpec("height", "TYPE_INT32", doc="pixels (a multiple of the model's; default: the model's)"),
    TensorSpec("width", "TYPE_INT32", doc="pixels (a multiple of the model's; default: the model's)"),
    TensorSpec("num_frames", "TYPE_INT32", doc="a video's frame count: 1 + a multiple of its VAE's temporal "
               "factor (default: the model's)"),
    TensorSpec("seconds", "TYPE_FP32", doc="a video's length at the model's frame rate (seconds x fps + 1 "
               "frames; OpenAI's `seconds`)"),
    TensorSpec("seed", "TYPE_INT64", doc="the noise's seed (default: a random one)"),
    TensorSpec("step_cache", "TYPE_STRING", doc="off, first_block or first_block:THRESHOLD: this request's "
               "step cache (default: the model's)"),
    # a LoRA adapter the model serves (its lora_adapters parameter), and its scale (1.0 unless given)
    TensorSpec("lora", "TYPE_STRING", doc="a LoRA adapter the model serves (its lora_adapters)"),
    TensorSpec("lora_scale", "TYPE_FP32", doc="the adapter's scale (default 1)"),
]
# The options only a video model reads: the image endpoints and commands leave them out.
VIDEO_OPTIONS = frozenset({"num_frames", "seconds", "guidance_scale_2"})


# -- diffusion (dynamic batching)
def diffusion_inputs(embeds_dtype: str = "float32") -> list[TensorSpec]:
    embeds_type = EMBEDS_TYPES[embeds_dtype]
    return [
        TensorSpec("prompt", "TYPE_STRING"),
        TensorSpec("prompt_embeds", embeds_type, dims=(-1, -1), kind="array"),
        TensorSpec("negative_prompt_embeds", embeds_type, dims=(-1, -1), kind="array"),
        # beside prompt_embeds, for a family whose DiT reads a pooled embedding (FLUX.1); [0]: none
        TensorSpec("pooled_prompt_embeds", embeds_type, dims=(-1,), kind="array"),
        # input images for a family that takes them (FLUX.2's reference images): one RGB image as
        # pixels, or one or several encoded PNG / JPEG / WebP files (docs/models.md, "Input images")
        TensorSpec("image", "TYPE_UINT8", dims=(-1, -1, 3), kind="array"),
        TensorSpec("images", "TYPE_STRING", dims=(-1,), kind="blobs"),
        *DIFFUSION_OPTIONS,
    ]


def diffusion_outputs() -> list[TensorSpec]:
    return [
        # what the model's family makes: an image, or a video's frames and their frame rate
        TensorSpec("image", "TYPE_UINT8", dims=(-1, -1, 3)),
        TensorSpec("video", "TYPE_UINT8", dims=(-1, -1, -1, 3)),  # [F, H, W, 3]
        TensorSpec("fps", "TYPE_FP32"),
        # Sent only by a decoupled diffusion model (docs/models.md, "Progress"): one response per
        # denoising step, before the image's.
        TensorSpec("step", "TYPE_INT32"),
        TensorSpec("total_steps", "TYPE_INT32"),
    ]


# -- speech (decoupled): a thinker's reply spoken, the audio streamed in chunks as the talker makes
# its codec frames (Qwen-Omni's talker and codec decoder; the thinker is `ar`'s model)
SPEECH_INPUTS = [
    TensorSpec("text_input", "TYPE_STRING", optional=False, doc="the prompt the thinker answered, as it read it "
               "(its chat template applied)"),
    TensorSpec("reply_ids", "TYPE_INT64", dims=(-1,), kind="list", optional=False,
               doc="the thinker's reply, its token ids (ar's token_ids output)"),
    TensorSpec("voice", "TYPE_STRING", doc="one of the model's speakers (default: the model's)"),
    TensorSpec("temperature", "TYPE_FP32", doc="the talker's sampling temperature; 0 is greedy (default: the "
               "model's)"),
    TensorSpec("top_p", "TYPE_FP32", doc="the talker's nucleus"),
    TensorSpec("top_k", "TYPE_INT32", doc="the talker's top-k"),
    TensorSpec("repetition_penalty", "TYPE_FP32", doc="the talker's repetition penalty over its codes"),
    TensorSpec("max_tokens", "TYPE_INT32", doc="the most codec frames (the audio's length bound)"),
    TensorSpec("min_tokens", "TYPE_INT32", doc="codec frames before the end of speech may come"),
    TensorSpec("seed", "TYPE_INT64", doc="the talker's seed (default: a random one)"),
    TensorSpec("chunk_frames", "TYPE_INT32", doc="codec frames an audio chunk waits for (default: the model's)"),
    TensorSpec("first_chunk_frames", "TYPE_INT32", doc="codec frames the first audio chunk waits for: fewer, and "
               "the first audio leaves sooner; each chunk after it at most twice the one before (default: the "
               "model's, at most chunk_frames)"),
    # a reply to a prompt with audio or images: what ar's return_heard_states gives (its outputs of these names)
    TensorSpec("prompt_ids", "TYPE_INT64", dims=(-1,), kind="list", doc="the prompt's token ids as the thinker "
               "read them (its audio markers widened; ar's prompt_token_ids), in place of text_input's"),
    TensorSpec("heard_states", "TYPE_FP32", dims=(-1, -1), kind="array", doc="the thinker's states at the "
               "prompt's audio and image tokens, of the layer the talker reads (ar's heard_states)"),
    TensorSpec("prompt_positions", "TYPE_INT64", dims=(3, -1), kind="array", doc="a prompt with images: the "
               "thinker's rotary positions of prompt_ids, [3, tokens] (ar's prompt_positions)"),
    # a Qwen2.5-Omni talker's input: what ar's return_thinker_states gives
    TensorSpec("thinker_states", "TYPE_FP32", dims=(-1, -1), kind="array", doc="the thinker's states (layer 0's "
               "input plus the last layer's) at each token of prompt_ids and each of reply_ids but the last "
               "(ar's thinker_states, its responses' one after another): what a Qwen2.5-Omni talker reads"),
]
SPEECH_OUTPUTS = [
    TensorSpec("audio", "TYPE_FP32", dims=(-1,)),  # the next samples of the waveform, in [-1, 1]
    TensorSpec("sample_rate", "TYPE_INT32"),
    TensorSpec("codes", "TYPE_INT64", dims=(-1, -1)),  # [codebooks, frames]: the frames these samples end
    TensorSpec("finish_reason", "TYPE_STRING"),  # on the last response: stop (end of speech) or length
]
# The speech options as omni takes them: the talker's sampling prefixed `talker_` (the plain names are
# the thinker's, `ar`'s), the voice and the chunking as they are.
TALKER_PREFIX = "talker_"
UNPREFIXED = ("voice", "chunk_frames", "first_chunk_frames")  # the speech stage's own, not the talker's sampling
SPEECH_OPTIONS = [
    replace(spec, name=spec.name if spec.name in UNPREFIXED else TALKER_PREFIX + spec.name)
    for spec in SPEECH_INPUTS
    if spec.name not in ("text_input", "reply_ids", "prompt_ids", "heard_states", "thinker_states", "prompt_positions")
]


# -- omni (decoupled BLS scheduler)
OMNI_INPUTS = [
    TensorSpec("text_input", "TYPE_STRING", optional=False),
    TensorSpec("modalities", "TYPE_STRING", dims=(-1,), kind="list"),
    TensorSpec("enhance_prompt", "TYPE_BOOL"),
    TensorSpec("stream", "TYPE_BOOL"),
    TensorSpec("num_images", "TYPE_INT32"),
    TensorSpec("parameters", "TYPE_STRING"),  # JSON: any option below, and the text options
    # `parameters` under a name Triton's HTTP /generate does not reserve
    TensorSpec("options", "TYPE_STRING"),
    # text options (as `ar` takes them)
    TensorSpec("max_tokens", "TYPE_INT32"),
    TensorSpec("temperature", "TYPE_FP32"),
    TensorSpec("top_p", "TYPE_FP32"),
    TensorSpec("top_k", "TYPE_INT32"),
    # the diffusion options (as `diffusion` takes them); `seed` seeds both stages
    *DIFFUSION_OPTIONS,
    # input image files (text + image -> image), as `diffusion`'s `images`; a tensor only, never JSON
    TensorSpec("images", "TYPE_STRING", dims=(-1,), kind="blobs"),
    # audio files the thinker hears (a Qwen3-Omni thinker on `ar`), before the prompt's text in its
    # user turn; a tensor only, never JSON
    TensorSpec("input_audio", "TYPE_STRING", dims=(-1,), kind="blobs"),
    # modalities with "audio": the reply spoken (the speech stage's options)
    *SPEECH_OPTIONS,
]
# A streamed response carries the outputs of one event; the non-streaming
# response carries them all.
OMNI_OUTPUTS = [
    TensorSpec("text_output", "TYPE_STRING", dims=(-1,)),
    TensorSpec("finish_reason", "TYPE_STRING", dims=(-1,)),
    TensorSpec("enhanced_prompt_delta", "TYPE_STRING", dims=(-1,)),
    TensorSpec("enhanced_prompt", "TYPE_STRING", dims=(-1,)),
    TensorSpec("stage", "TYPE_STRING", dims=(-1,)),
    TensorSpec("step", "TYPE_INT32", dims=(-1,)),
    TensorSpec("total_steps", "TYPE_INT32", dims=(-1,)),
    TensorSpec("image", "TYPE_UINT8", dims=(-1, -1, -1, 3)),  # [num_images, H, W, 3]
    TensorSpec("image_index", "TYPE_INT32", dims=(-1,)),  # which of num_images (images or videos)
    # The image's shape again: Triton's HTTP /generate flattens tensors to JSON lists.
    TensorSpec("image_shape", "TYPE_INT32", dims=(4,)),
    # A video model's answer in place of the image: [num_images, F, H, W, 3], its shape, its frame rate
    TensorSpec("video", "TYPE_UINT8", dims=(-1, -1, -1, -1, 3)),
    TensorSpec("video_shape", "TYPE_INT32", dims=(5,)),
    TensorSpec("fps", "TYPE_FP32"),
    # modalities with "audio": the next samples of the spoken reply, their rate, the codec frames they end
    TensorSpec("audio", "TYPE_FP32", dims=(-1,)),
    TensorSpec("sample_rate", "TYPE_INT32"),
    TensorSpec("audio_codes", "TYPE_INT64", dims=(-1, -1)),
]


def scalar_inputs() -> dict[str, TensorSpec]:
    """Every one-value, non-text input of any model, by name (one type per
    name across models: a test checks it)."""
    specs = [*AR_GENERATE_INPUTS, *diffusion_inputs(), *OMNI_INPUTS]
    return {s.name: s for s in specs if s.kind == "scalar" and s.data_type != "TYPE_STRING"}
