/*
 * flashmsa — MiniMax Sparse Attention (MSA) training kernels. C ABI.
 *
 * The contract is docs/semantics.md: selection, forward, backward, modes, errors, numerics.
 *
 * Conventions
 * - Tensors pass as views (flashmsa_tensor_t): pointer, dtype, shape, strides (in ELEMENTS),
 *   device. Memory belongs to the caller; the library never allocates device memory behind the
 *   caller's back (it asks for a workspace through the *_workspace_size queries).
 * - An optional tensor is "absent" when data == NULL and ndim == 0 (FLASHMSA_TENSOR_NONE).
 *   A present tensor with zero elements may have data == NULL.
 * - Every entry point validates all of its arguments before anything runs; a call that fails
 *   writes none of its outputs. The failure is a status code plus a thread-local message
 *   (flashmsa_last_error()) naming the argument and the expected vs actual value.
 * - Varlen first: q [total, Hq, D] with cu_seqlens [B+1] int32 and max_seqlen. A batched call
 *   passes q, k, v, qp, kp, out, dout, dq, ... as [B, S, H, D] and no cu_seqlens; it means the
 *   same as varlen with B sequences of length S, and every per-token tensor that has no batched
 *   form (lse, dlse, proxy_lse, indices) keeps its varlen layout with total = B * S.
 */
#ifndef FLASHMSA_FLASHMSA_H_
#define FLASHMSA_FLASHMSA_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define FLASHMSA_API __declspec(dllexport)
#else
#define FLASHMSA_API __attribute__((visibility("default")))
#endif

#define FLASHMSA_VERSION_MAJOR 0
#define FLASHMSA_VERSION_MINOR 1
#define FLASHMSA_VERSION_PATCH 0

/* Block size of the selection (keys per block). Fixed by the spec. */
#define FLASHMSA_BLOCK_SIZE 128
/* Largest topk the API accepts. */
#define FLASHMSA_MAX_TOPK 64
/* Largest softmax_scale / proxy_scale accepted: larger ones overflow the fp32 logits (and lse). */
#define FLASHMSA_MAX_SCALE 1e4
/* Largest tensor rank. */
#define FLASHMSA_MAX_DIMS 4

typedef enum flashmsa_status {
  FLASHMSA_SUCCESS = 0,
  FLASHMSA_ERROR_INVALID_ARGUMENT = 1, /* bad shape, dtype, stride, ratio, value, ... */
  FLASHMSA_ERROR_NOT_SUPPORTED = 2,    /* valid per the spec but not built / instantiated */
  FLASHMSA_ERROR_DEVICE = 3,           /* a CUDA runtime error */
  FLASHMSA_ERROR_WORKSPACE = 4,        /* workspace missing or too small */
  FLASHMSA_ERROR_INTERNAL = 5
} flashmsa_status_t;

typedef enum flashmsa_dtype {
  FLASHMSA_DTYPE_BF16 = 0,
  FLASHMSA_DTYPE_FP16 = 1,
  FLASHMSA_DTYPE_FP32 = 2, /* inputs: CPU backend only (testing) */
  FLASHMSA_DTYPE_FP64 = 3, /* inputs: CPU backend only (testing) */
  FLASHMSA_DTYPE_INT32 = 4
} flashmsa_dtype_t;

typedef enum flashmsa_device_type {
  FLASHMSA_DEVICE_CPU = 0,
  FLASHMSA_DEVICE_CUDA = 1
} flashmsa_device_type_t;

typedef struct flashmsa_tensor {
  void* data;
  flashmsa_dtype_t dtype;
  int32_t ndim;                        /* 0 with data == NULL: absent */
  int64_t shape[FLASHMSA_MAX_DIMS];
  int64_t strides[FLASHMSA_MAX_DIMS];  /* in elements; strides[ndim-1] must be 1 */
  flashmsa_device_type_t device_type;
  int32_t device_id;
} flashmsa_tensor_t;

typedef enum flashmsa_mode {
  FLASHMSA_MODE_SPARSE = 0, /* selection by the proxy, then sparse attention */
  FLASHMSA_MODE_DENSE = 1,  /* warmup: dense causal attention, kl over the full causal set */
  FLASHMSA_MODE_GIVEN = 2   /* caller-provided indices [Hp, total, topk] */
} flashmsa_mode_t;

/* Online-softmax numerics of the forward (SPEC section 3). Never a silent default:
 * TRAIN uses the exact running max (rescale threshold 0), INFER lazy rescaling with
 * threshold 8 (log2 units). The CPU reference computes in fp64 and is exact in both. */
typedef enum flashmsa_numerics {
  FLASHMSA_NUMERICS_TRAIN = 0,
  FLASHMSA_NUMERICS_INFER = 1
} flashmsa_numerics_t;

/* The precision the selection ranks blocks in (SPARSE mode and flashmsa_select). INPUT: the
 * proxy logits of qp, kp as given. FP8: qp and kp quantised to e4m3 first (OCP E4M3FN, round to
 * nearest even, saturating at 448), qp with one scale per (query row, proxy head), kp with one per
 * (128-token key block, proxy key head): scale = amax / 448 in fp32 over the group's values (read
 * as fp32), the stored value e4m3(x * (448 / amax)), dequantised as e4m3 value x scale; a group
 * whose amax is 0 is all zeros, one with a non-finite value is all NaN. The blocks are ranked by
 * the block max of the dequantised logits, as in INPUT. Only the ranking changes: proxy_lse, the
 * kl and every gradient use the unquantised qp, kp over the selected blocks. Both backends run it
 * (CUDA: e4m3 tensor cores, which may swap blocks whose scores agree to ~1e-2). */
typedef enum flashmsa_selection {
  FLASHMSA_SELECTION_INPUT = 0,
  FLASHMSA_SELECTION_FP8 = 1
} flashmsa_selection_t;

/* ---- selection ------------------------------------------------------------------------ */
typedef struct flashmsa_select_args {
  flashmsa_tensor_t qp;          /* [total, Hp, Dp] or [B, S, Hp, Dp] */
  flashmsa_tensor_t kp;          /* [total, Hpk, Dp] or [B, S, Hpk, Dp] */
  flashmsa_tensor_t cu_seqlens;  /* [B+1] int32 (varlen); absent for batched inputs */
  int64_t max_seqlen;            /* varlen: >= every length; batched: 0 or S */
  flashmsa_tensor_t cu_seqlens_q; /* optional [S+1] int32: query segments (see "Query segments" below) */
  flashmsa_tensor_t q_origin;     /* [S, 2] int32, with cu_seqlens_q: (key sequence, first position) */
  int64_t max_seqlen_q;           /* with cu_seqlens_q: >= every segment's length */
  int32_t topk;                  /* 1..FLASHMSA_MAX_TOPK, counts the local block */
  double proxy_scale;            /* 0 selects 1/sqrt(Dp); else finite, > 0 and <= FLASHMSA_MAX_SCALE */
  flashmsa_selection_t selection; /* the ranking's precision (INPUT or FP8, above) */
  flashmsa_tensor_t indices;     /* out: [Hp, total, topk] int32 */
  flashmsa_tensor_t proxy_lse;   /* out, optional: [Hp, total] fp32 */
  flashmsa_tensor_t status;      /* optional status words (see "Metadata faults" below) */
  void* stream;                  /* cudaStream_t for the CUDA backend; ignored on the CPU */
} flashmsa_select_args_t;

/* ---- forward -------------------------------------------------------------------------- */
typedef struct flashmsa_fwd_args {
  flashmsa_tensor_t q;           /* [total, Hq, D] or [B, S, Hq, D] */
  flashmsa_tensor_t k, v;        /* [total, Hkv, D] */
  flashmsa_tensor_t qp;          /* [total, Hp, Dp]; required in SPARSE mode, optional otherwise */
  flashmsa_tensor_t kp;          /* [total, Hpk, Dp]; given together with qp */
  flashmsa_tensor_t cu_seqlens;
  int64_t max_seqlen;
  flashmsa_tensor_t cu_seqlens_q; /* optional [S+1] int32: query segments (see "Query segments" below) */
  flashmsa_tensor_t q_origin;     /* [S, 2] int32, with cu_seqlens_q: (key sequence, first position) */
  int64_t max_seqlen_q;           /* with cu_seqlens_q: >= every segment's length */
  flashmsa_mode_t mode;
  flashmsa_numerics_t numerics;
  flashmsa_selection_t selection; /* SPARSE: the ranking's precision (INPUT or FP8, above); else ignored */
  int32_t topk;                  /* SPARSE: 1..64; GIVEN: taken from indices; DENSE: ignored */
  double softmax_scale;          /* 0 selects 1/sqrt(D); else finite, > 0 and <= FLASHMSA_MAX_SCALE */
  double proxy_scale;            /* 0 selects 1/sqrt(Dp); likewise */
  int32_t compute_kl;            /* write the kl value (else kl = 0, a placeholder) */
  int32_t validate;              /* opt-in data checks (synchronises on the GPU) */
  flashmsa_tensor_t indices;     /* SPARSE: out (optional), GIVEN: in, DENSE: absent */
  flashmsa_tensor_t out;         /* [total, Hq, D], dtype of q */
  flashmsa_tensor_t out_lo;      /* optional, like out: the low part out_lo = dtype(O - dtype(O)) of the
                                    unrounded output O, for the backward's precise dpsum */
  flashmsa_tensor_t lse;         /* [Hq, total] fp32 (fp64 allowed for fp64 inputs) */
  flashmsa_tensor_t proxy_lse;   /* optional, [Hp, total] fp32 (needs qp, kp) */
  flashmsa_tensor_t kl;          /* optional, scalar ([] or [1]) fp32 (fp64 for fp64 inputs) */
  flashmsa_tensor_t status;      /* optional status words (see "Metadata faults" below) */
  void* stream;
} flashmsa_fwd_args_t;

/* ---- backward ------------------------------------------------------------------------- */
typedef struct flashmsa_bwd_args {
  flashmsa_tensor_t q, k, v;
  flashmsa_tensor_t qp, kp;      /* optional together; needed for the proxy gradient */
  flashmsa_tensor_t cu_seqlens;
  int64_t max_seqlen;
  flashmsa_tensor_t cu_seqlens_q; /* optional [S+1] int32: query segments (see "Query segments" below) */
  flashmsa_tensor_t q_origin;     /* [S, 2] int32, with cu_seqlens_q: (key sequence, first position) */
  int64_t max_seqlen_q;           /* with cu_seqlens_q: >= every segment's length */
  flashmsa_mode_t mode;          /* SPARSE and GIVEN read indices; DENSE reads none */
  double softmax_scale;
  double proxy_scale;
  int32_t deterministic;
  int32_t validate;
  flashmsa_tensor_t indices;     /* [Hp, total, topk] int32 (SPARSE / GIVEN) */
  flashmsa_tensor_t out;         /* [total, Hq, D] forward output */
  flashmsa_tensor_t out_lo;      /* optional: the forward's out_lo; dpsum then uses out + out_lo */
  flashmsa_tensor_t lse;         /* [Hq, total] forward lse */
  flashmsa_tensor_t proxy_lse;   /* optional [Hp, total]; recomputed when absent */
  flashmsa_tensor_t dout;        /* [total, Hq, D] */
  flashmsa_tensor_t dlse;        /* optional [Hq, total] fp32: gradient of lse */
  flashmsa_tensor_t dkl;         /* optional scalar fp32: upstream gradient g of kl (absent: 0) */
  flashmsa_tensor_t dq, dk, dv;  /* outputs, shapes and dtypes of q, k, v */
  flashmsa_tensor_t dqp, dkp;    /* outputs; required when qp, kp are given */
  flashmsa_tensor_t kl;          /* optional out, scalar ([] or [1]) fp32 (fp64 for fp64 inputs): the kl
                                    value of the forward with the same inputs, computed by the proxy
                                    side of this backward at no extra pass (needs qp, kp); 0 where the
                                    sets are empty. A training loop's cheap way to log kl. */
  flashmsa_tensor_t status;      /* optional status words (see "Metadata faults" below) */
  void* stream;
} flashmsa_bwd_args_t;

/* ---- query segments (context parallelism) ---------------------------------------------
 * By default every per-query tensor row is a key position too: token t of sequence b is the query
 * and the key at position t - cu_seqlens[b]. With cu_seqlens_q, the queries are a subset of
 * positions (a chunk of a sequence against the whole prefix of its keys, as a context-parallel
 * rank holds them):
 *   - k, v, kp (and dk, dv, dkp) keep the layout cu_seqlens gives: B key sequences, total_k rows;
 *   - q, qp, out, out_lo, dout, dq, dqp have total_q = cu_seqlens_q[S] rows, and lse, dlse,
 *     proxy_lse, indices [H, total_q(, topk)];
 *   - rows [cu_seqlens_q[s], cu_seqlens_q[s+1]) of segment s are the queries at positions
 *     q_origin[s][1], q_origin[s][1] + 1, ... of key sequence q_origin[s][0].
 * The causal mask, the blocks (their ids count from the key sequence's start), the local block,
 * the kl's normaliser (N = Hp * total_q) and every gradient are those of the whole sequence,
 * restricted to these queries; segments may share a key sequence (dk, dv, dkp then sum over them).
 * Requirements: varlen inputs; cu_seqlens_q[0] = 0, non-decreasing, last value total_q, every
 * segment length <= max_seqlen_q; 0 <= q_origin[s][0] < B and 0 <= q_origin[s][1] with
 * q_origin[s][1] + length(s) <= the length of key sequence q_origin[s][0]. The CPU backend checks
 * the values before it computes (INVALID_ARGUMENT); the CUDA backend checks them on the device like
 * cu_seqlens (FLASHMSA_FAULT_SEGMENTS, "Metadata faults" below) and runs segments in every call of
 * the SPARSE and GIVEN modes (DENSE with segments: the forward without the kl value only, so far;
 * the rest NOT_SUPPORTED). */

/* Initialise an argument struct: every tensor absent, scales 0 (defaults), TRAIN numerics. */
FLASHMSA_API void flashmsa_select_args_init(flashmsa_select_args_t* args);
FLASHMSA_API void flashmsa_fwd_args_init(flashmsa_fwd_args_t* args);
FLASHMSA_API void flashmsa_bwd_args_init(flashmsa_bwd_args_t* args);

/* Workspace queries: bytes of device (or host, for the CPU backend) scratch the call needs.
 * They validate the arguments' metadata like the calls themselves. */
FLASHMSA_API flashmsa_status_t flashmsa_select_workspace_size(const flashmsa_select_args_t* args,
                                                              size_t* bytes);
FLASHMSA_API flashmsa_status_t flashmsa_fwd_workspace_size(const flashmsa_fwd_args_t* args,
                                                           size_t* bytes);
FLASHMSA_API flashmsa_status_t flashmsa_bwd_workspace_size(const flashmsa_bwd_args_t* args,
                                                           size_t* bytes);

/* The operations. workspace may be NULL when the query returned 0; otherwise it is device memory of at
 * least the queried bytes, 16-byte aligned (cudaMalloc's and torch's allocations are). */
FLASHMSA_API flashmsa_status_t flashmsa_select(const flashmsa_select_args_t* args, void* workspace,
                                               size_t workspace_bytes);
FLASHMSA_API flashmsa_status_t flashmsa_fwd(const flashmsa_fwd_args_t* args, void* workspace,
                                            size_t workspace_bytes);
FLASHMSA_API flashmsa_status_t flashmsa_bwd(const flashmsa_bwd_args_t* args, void* workspace,
                                            size_t workspace_bytes);

/* ---- metadata faults (CUDA backend) ---------------------------------------------------
 * cu_seqlens lives on the device, so the CUDA backend cannot check it on the host without a
 * synchronisation (the opt-in `validate` does exactly that). On the default path every varlen
 * CUDA call checks cu_seqlens on the device instead: first value 0, non-decreasing, last value
 * total, values in [0, total], every length <= max_seqlen. Whatever the values, no kernel reads
 * or writes outside the caller's buffers. A call that finds a fault computes nothing from the
 * metadata: all its outputs are poisoned (floating-point outputs NaN, indices INT32_MIN), and
 * it records the fault in the caller's status words, if given:
 *   status: int32 [FLASHMSA_STATUS_WORDS], contiguous, zeroed by the caller once; device memory
 *           of the call's device, or page-locked host memory (cudaHostAlloc / pinned tensors),
 *           which the host can read without a synchronisation.
 *   word 0: OR of the FLASHMSA_FAULT_* bits of every faulting call;  word 1: OR of the
 *   FLASHMSA_FAULT_OP_* bits of those calls;  word 2: their number;  words 3-7 describe the first
 *   one: 1 + the first faulting position b, cu_seqlens[b], cu_seqlens[b + 1], total, max_seqlen.
 * Calls with a fault return FLASHMSA_SUCCESS (the fault is found after they return); read the
 * words with flashmsa_check_status. The CPU backend checks the data before it computes and
 * fails at once (it never writes the status). */
#define FLASHMSA_STATUS_WORDS 8
#define FLASHMSA_FAULT_FIRST_NOT_ZERO 1    /* cu_seqlens[0] != 0 */
#define FLASHMSA_FAULT_NEGATIVE 2          /* a value < 0 */
#define FLASHMSA_FAULT_DECREASING 4        /* cu_seqlens[b + 1] < cu_seqlens[b] */
#define FLASHMSA_FAULT_ABOVE_TOTAL 8       /* a value > total */
#define FLASHMSA_FAULT_LAST_NOT_TOTAL 16   /* cu_seqlens[B] != total */
#define FLASHMSA_FAULT_ABOVE_MAX_SEQLEN 32 /* a sequence longer than max_seqlen */
#define FLASHMSA_FAULT_SEGMENTS 64         /* query segments (cu_seqlens_q, q_origin) that do not fit the key
                                              sequences; words 3-7 then describe the first faulting segment s:
                                              1 + s, cu_seqlens_q[s], cu_seqlens_q[s + 1], total_q, max_seqlen_q */
#define FLASHMSA_FAULT_OP_SELECT 1
#define FLASHMSA_FAULT_OP_FWD 2
#define FLASHMSA_FAULT_OP_BWD 4
/* flags of flashmsa_check_status */
#define FLASHMSA_CHECK_SYNC 1   /* synchronise `stream` first (always done for device memory) */
#define FLASHMSA_CHECK_RESET 2  /* zero the words after reading them */

/* Reads status words: FLASHMSA_SUCCESS when no fault was recorded, else
 * FLASHMSA_ERROR_INVALID_ARGUMENT with a message naming the faults (flashmsa_last_error).
 * Device-memory words are copied on `stream` and synchronised; host words are read as they are,
 * after synchronising `stream` when flags has FLASHMSA_CHECK_SYNC. faults (optional) receives
 * word 0. This is the only call that synchronises for the status. */
FLASHMSA_API flashmsa_status_t flashmsa_check_status(const flashmsa_tensor_t* status, void* stream, int32_t flags,
                                                     int32_t* faults);

/* The message of the last failed call on this thread ("" after a success). */
FLASHMSA_API const char* flashmsa_last_error(void);
FLASHMSA_API const char* flashmsa_status_string(flashmsa_status_t status);
FLASHMSA_API const char* flashmsa_dtype_name(flashmsa_dtype_t dtype);
/* 1 when the library was built with its CUDA backend and a CUDA device is visible. */
FLASHMSA_API int flashmsa_cuda_available(void);
FLASHMSA_API const char* flashmsa_version(void);

/* ABI of this header: bindings compare it (and the struct sizes) with what they were written
 * against before their first call. Bumped whenever a struct or an enum changes. */
#define FLASHMSA_ABI_VERSION 6
typedef enum flashmsa_struct {
  FLASHMSA_STRUCT_TENSOR = 0,
  FLASHMSA_STRUCT_SELECT_ARGS = 1,
  FLASHMSA_STRUCT_FWD_ARGS = 2,
  FLASHMSA_STRUCT_BWD_ARGS = 3
} flashmsa_struct_t;
FLASHMSA_API int flashmsa_abi_version(void);
/* sizeof the struct in this build; 0 for an unknown id. */
FLASHMSA_API size_t flashmsa_struct_size(flashmsa_struct_t which);
/* The value this build gives a constant of this header, looked up by its name as spelled here
 * ("FLASHMSA_MODE_GIVEN", "FLASHMSA_MAX_TOPK", ...), so that bindings can compare every value
 * they mirror: each enumerator of flashmsa_status_t, flashmsa_dtype_t, flashmsa_device_type_t,
 * flashmsa_mode_t, flashmsa_numerics_t, flashmsa_selection_t and flashmsa_struct_t, and each numeric macro
 * (FLASHMSA_VERSION_*, FLASHMSA_BLOCK_SIZE, FLASHMSA_MAX_TOPK, FLASHMSA_MAX_DIMS,
 * FLASHMSA_MAX_SCALE (an integral value, reported exactly), FLASHMSA_STATUS_WORDS,
 * FLASHMSA_FAULT_*, FLASHMSA_CHECK_*, FLASHMSA_ABI_VERSION). Returns 1 and writes *value (when
 * value is not NULL) for a known name; returns 0 and writes nothing for an unknown name or NULL. */
FLASHMSA_API int flashmsa_abi_constant(const char* name, int64_t* value);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* FLASHMSA_FLASHMSA_H_ */
