// keyfleet's batch crypto kernel: one N-API call per chunk over OpenSSL's EVP API (the
// OpenSSL that Node itself ships and exports). The per-call cost of Node's cipher objects,
// not AES, is the wall for small items; here one EVP context is reused for the whole chunk
// and only the nonce is reset per item. A chunk's output is its result records, written into
// a caller-provided buffer, byte for byte what the JavaScript kernel writes; a sync request's
// is the items of its JSON response. formatResults turns records into the NDJSON result lines.
//
// Input layout (shared/chunk-codec.ts): per item [u8 flag][u32le length][length bytes].
// Result records (shared/result-codec.ts): per item [u8 kind][u32le length][payload].
#define _GNU_SOURCE // SCHED_IDLE
#define NAPI_VERSION 8
#include <errno.h>
#include <node_api.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/rand.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define NONCE 12
#define TAG 16
#define KEY 32

enum { OP_ENCRYPT = 0, OP_DECRYPT = 1, OP_REWRAP = 2 };
enum { ITEM_OK = 0, ITEM_NOT_STRING = 1, ITEM_TOO_LARGE = 2 };
// Indices into the error table JavaScript registers (the catalogue stays the one source).
enum { E_INVALID_ITEM = 0, E_ITEM_TOO_LARGE, E_DECRYPT_FAILED, E_VERSION_DISABLED, E_NOT_UTF8, E_INVALID_ENCODING, E_COUNT };

static char *error_json[E_COUNT];

// Per thread (each worker thread loads the addon in its own environment): the cipher fetched
// once from the provider, two contexts and the scratch buffers, reused by every call. In
// OpenSSL 3 an init with EVP_aes_256_gcm() does an implicit provider fetch each time, and a
// context per call costs an allocation and that fetch: together more than sealing ten items.
static __thread EVP_CIPHER *gcm;
static __thread EVP_CIPHER_CTX *tl_enc, *tl_dec;
static __thread int tl_enc_ready, tl_dec_ready, tl_enc_keyed, tl_dec_keyed;
// The key each context holds, so a call with the same key skips the key schedule.
static __thread uint8_t tl_enc_key[KEY], tl_dec_key[KEY];
static __thread uint8_t *tl_buf;
static __thread size_t tl_buf_cap;

// Nonces come from a per-thread block refilled by RAND_bytes 4,096 nonces at a time, so a
// 10-item request does not pay a DRBG call; each nonce is handed out once.
#define NONCE_BLOCK 4096
static __thread uint8_t tl_nonces[NONCE * NONCE_BLOCK];
static __thread size_t tl_nonce_at = NONCE_BLOCK;

static const uint8_t *next_nonce(void) {
  if (tl_nonce_at == NONCE_BLOCK) {
    if (RAND_bytes(tl_nonces, sizeof tl_nonces) != 1) return NULL;
    tl_nonce_at = 0;
  }
  return tl_nonces + NONCE * tl_nonce_at++;
}

static uint8_t *scratch_of(size_t bytes) {
  if (bytes > tl_buf_cap) {
    if (tl_buf) { OPENSSL_cleanse(tl_buf, tl_buf_cap); free(tl_buf); }
    tl_buf_cap = bytes < 65536 ? 65536 : bytes;
    tl_buf = malloc(tl_buf_cap);
    if (!tl_buf) tl_buf_cap = 0;
  }
  return tl_buf;
}
static size_t error_len[E_COUNT];

typedef struct {
  uint8_t *p;
  size_t at, cap;
  int overflow;
} out_t;

static inline void put(out_t *o, const void *s, size_t n) {
  if (o->at + n > o->cap) { o->overflow = 1; return; }
  memcpy(o->p + o->at, s, n);
  o->at += n;
}
static inline void putc_(out_t *o, uint8_t c) {
  if (o->at + 1 > o->cap) { o->overflow = 1; return; }
  o->p[o->at++] = c;
}
static void put_uint(out_t *o, uint64_t v) {
  char tmp[24];
  int n = 0;
  do { tmp[n++] = (char)('0' + v % 10); v /= 10; } while (v);
  if (o->at + n > o->cap) { o->overflow = 1; return; }
  while (n) o->p[o->at++] = (uint8_t)tmp[--n];
}

static const char B64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
// B64's inverse, -1 where a byte is not in it. A constant: every thread that loads the addon
// shares it, so nothing may write it at load (threads already decoding would read the gap).
static const int8_t B64_REV[256] = {
  -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
  -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
  -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 62, -1, -1, -1, 63,
  52, 53, 54, 55, 56, 57, 58, 59, 60, 61, -1, -1, -1, -1, -1, -1,
  -1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14,
  15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, -1, -1, -1, -1, -1,
  -1, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40,
  41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, -1, -1, -1, -1, -1,
  -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
  -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
  -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
  -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
  -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
  -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
  -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
  -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
};

static void put_base64(out_t *o, const uint8_t *s, size_t n) {
  size_t need = ((n + 2) / 3) * 4;
  if (o->at + need > o->cap) { o->overflow = 1; return; }
  uint8_t *d = o->p + o->at;
  size_t i = 0;
  for (; i + 3 <= n; i += 3) {
    uint32_t v = ((uint32_t)s[i] << 16) | ((uint32_t)s[i + 1] << 8) | s[i + 2];
    *d++ = B64[v >> 18]; *d++ = B64[(v >> 12) & 63]; *d++ = B64[(v >> 6) & 63]; *d++ = B64[v & 63];
  }
  if (n - i == 1) {
    uint32_t v = (uint32_t)s[i] << 16;
    *d++ = B64[v >> 18]; *d++ = B64[(v >> 12) & 63]; *d++ = '='; *d++ = '=';
  } else if (n - i == 2) {
    uint32_t v = ((uint32_t)s[i] << 16) | ((uint32_t)s[i + 1] << 8);
    *d++ = B64[v >> 18]; *d++ = B64[(v >> 12) & 63]; *d++ = B64[(v >> 6) & 63]; *d++ = '=';
  }
  o->at += need;
}

// Canonical base64: standard alphabet, length a multiple of 4, at most two '=' at the end, and
// the bits the padding leaves over zero (one spelling per byte string). Returns decoded length, or -1.
static long decode_base64(const uint8_t *s, size_t n, uint8_t *d) {
  if (n % 4) return -1;
  size_t pad = 0;
  if (n && s[n - 1] == '=') pad++;
  if (n > 1 && s[n - 2] == '=') pad++;
  size_t out = 0;
  for (size_t i = 0; i < n; i += 4) {
    int32_t v = 0;
    for (int k = 0; k < 4; k++) {
      uint8_t c = s[i + k];
      int8_t r;
      if (c == '=' && i + 4 == n && k >= 4 - (int)pad) r = 0;
      else if ((r = B64_REV[c]) < 0) return -1;
      v = (v << 6) | r;
    }
    if (i + 4 == n && ((pad == 2 && (v & 0xFFFF)) || (pad == 1 && (v & 0xFF)))) return -1;
    d[out++] = (uint8_t)(v >> 16);
    if (!(i + 4 == n && pad == 2)) d[out++] = (uint8_t)(v >> 8);
    if (!(i + 4 == n && pad >= 1)) d[out++] = (uint8_t)v;
  }
  return (long)out;
}

static int valid_utf8(const uint8_t *s, size_t n) {
  size_t i = 0;
  while (i < n) {
    uint8_t c = s[i];
    if (c < 0x80) { i++; continue; }
    size_t len;
    uint32_t cp;
    if ((c & 0xE0) == 0xC0) { len = 2; cp = c & 0x1F; }
    else if ((c & 0xF0) == 0xE0) { len = 3; cp = c & 0x0F; }
    else if ((c & 0xF8) == 0xF0) { len = 4; cp = c & 0x07; }
    else return 0;
    if (i + len > n) return 0;
    for (size_t k = 1; k < len; k++) {
      if ((s[i + k] & 0xC0) != 0x80) return 0;
      cp = (cp << 6) | (s[i + k] & 0x3F);
    }
    if ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) || (len == 4 && (cp < 0x10000 || cp > 0x10FFFF))) return 0;
    if (cp >= 0xD800 && cp <= 0xDFFF) return 0;
    i += len;
  }
  return 1;
}

// JSON string body as JSON.stringify writes it: \" \\ \b \f \n \r \t, other controls \u00xx.
static void put_json_string(out_t *o, const uint8_t *s, size_t n) {
  static const char HEX[] = "0123456789abcdef";
  for (size_t i = 0; i < n; i++) {
    uint8_t c = s[i];
    if (c >= 0x20 && c != '"' && c != '\\') { putc_(o, c); continue; }
    putc_(o, '\\');
    switch (c) {
      case '"': putc_(o, '"'); break;
      case '\\': putc_(o, '\\'); break;
      case '\b': putc_(o, 'b'); break;
      case '\f': putc_(o, 'f'); break;
      case '\n': putc_(o, 'n'); break;
      case '\r': putc_(o, 'r'); break;
      case '\t': putc_(o, 't'); break;
      default: put(o, "u00", 3); putc_(o, HEX[c >> 4]); putc_(o, HEX[c & 15]);
    }
  }
}

typedef struct {
  uint32_t version;
  const uint8_t *key;
  const uint8_t *aad;
  size_t aad_len;
} version_t;

typedef struct {
  int op, base64_out, base64_in;
  // json: results as the items of a JSON array ({"ciphertext":…},) for a sync response, rather than records.
  int json;
  uint32_t max_item;
  uint32_t latest, min_dec;
  // The key versions as shared/crypto/key-ring.ts packs them: [u32 count][u32 stride], then per
  // version, in rising order, [u32 version][u32 aad length][32-byte key][aad], `stride` bytes apart.
  const uint8_t *versions;
  size_t nversions, stride;
  version_t latest_v;
  EVP_CIPHER_CTX *enc, *dec;
  uint8_t *scratch;           // decoded ciphertext, then plaintext
  uint32_t succeeded, failed;
  int newer;
} job_t;

static inline uint32_t get_u32le(const uint8_t *p) {
  return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

// A version by binary search, read in place: a call costs the same whatever the number of
// versions (a key rotated daily has hundreds), where reading each from a JavaScript object cost
// ~0.3 µs. 0 where it is absent, or its entry does not hold its associated data.
static int find_version(const job_t *j, uint32_t v, version_t *out) {
  size_t lo = 0, hi = j->nversions;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    const uint8_t *e = j->versions + 8 + mid * j->stride;
    uint32_t found = get_u32le(e);
    if (found < v) { lo = mid + 1; continue; }
    if (found > v) { hi = mid; continue; }
    uint32_t aad_len = get_u32le(e + 4);
    if (aad_len > j->stride - 8 - KEY) return 0;
    *out = (version_t){found, e + 8, e + 8 + KEY, aad_len};
    return 1;
  }
  return 0;
}

// Result record kinds, as in shared/result-codec.ts.
enum { R_CIPHERTEXT = 0, R_PLAINTEXT_UTF8 = 1, R_PLAINTEXT_BASE64 = 2, R_ERROR = 3 };

static void put_u32le(out_t *o, uint32_t v) {
  uint8_t b[4] = {(uint8_t)v, (uint8_t)(v >> 8), (uint8_t)(v >> 16), (uint8_t)(v >> 24)};
  put(o, b, 4);
}
static void put_record(out_t *o, uint8_t kind, size_t len) {
  putc_(o, kind);
  put_u32le(o, (uint32_t)len);
}

static void fail_item(job_t *j, out_t *o, int e) {
  if (j->json) {
    put(o, "{\"error\":", 9); put(o, error_json[e], error_len[e]); put(o, "},", 2);
  } else {
    put_record(o, R_ERROR, 1); putc_(o, (uint8_t)e);
  }
  j->failed++;
}

// `"ciphertext":"kf:vN:<base64>"` without its braces: in a sync item and in a result line.
static void put_ciphertext_field(out_t *o, uint32_t version, const uint8_t *sealed, size_t n) {
  put(o, "\"ciphertext\":\"kf:v", 18); put_uint(o, version); putc_(o, ':');
  put_base64(o, sealed, n);
  putc_(o, '"');
}

// `"plaintext":"…"` without its braces: base64, or the UTF-8 text as a JSON string.
static void put_plaintext_field(out_t *o, int base64, const uint8_t *pt, size_t n) {
  put(o, "\"plaintext\":\"", 13);
  if (base64) put_base64(o, pt, n); else put_json_string(o, pt, n);
  putc_(o, '"');
}

static void put_ciphertext(job_t *j, out_t *o, const uint8_t *sealed, size_t n) {
  if (j->json) {
    putc_(o, '{'); put_ciphertext_field(o, j->latest, sealed, n); put(o, "},", 2);
  } else {
    put_record(o, R_CIPHERTEXT, 4 + n); put_u32le(o, j->latest); put(o, sealed, n);
  }
}

static void put_plaintext(job_t *j, out_t *o, const uint8_t *pt, size_t n) {
  if (j->json) {
    putc_(o, '{'); put_plaintext_field(o, j->base64_out, pt, n); put(o, "},", 2);
  } else {
    put_record(o, j->base64_out ? R_PLAINTEXT_BASE64 : R_PLAINTEXT_UTF8, n); put(o, pt, n);
  }
}

// Seals under the latest version into buf as nonce ‖ ciphertext ‖ tag; returns its length, or 0.
static size_t seal(job_t *j, const uint8_t *pt, size_t n, uint8_t *buf) {
  const version_t *v = &j->latest_v;
  const uint8_t *nonce = next_nonce();
  int len = 0;
  if (!nonce) return 0;
  memcpy(buf, nonce, NONCE);
  if (!EVP_EncryptInit_ex(j->enc, NULL, NULL, NULL, nonce)) return 0;
  if (!EVP_EncryptUpdate(j->enc, NULL, &len, v->aad, (int)v->aad_len)) return 0;
  if (n && !EVP_EncryptUpdate(j->enc, buf + NONCE, &len, pt, (int)n)) return 0;
  if (!EVP_EncryptFinal_ex(j->enc, buf + NONCE + n, &len)) return 0;
  if (!EVP_CIPHER_CTX_ctrl(j->enc, EVP_CTRL_GCM_GET_TAG, TAG, buf + NONCE + n)) return 0;
  return NONCE + n + TAG;
}

// Opens `kf:vN:<base64>` into j->scratch; returns plaintext length, or -1 - error index.
static long open_item(job_t *j, const uint8_t *s, size_t n) {
  if (n < 6 || memcmp(s, "kf:v", 4) != 0) return -1 - E_DECRYPT_FAILED;
  size_t at = 4;
  uint64_t version = 0;
  while (at < n && at < 4 + 10 && s[at] >= '0' && s[at] <= '9') version = version * 10 + (s[at++] - '0');
  if (at == 4 || at - 4 > 9 || at >= n || s[at] != ':' || version < 1 || s[4] == '0') return -1 - E_DECRYPT_FAILED;
  at++;
  // The base64 before the version, as the js kernel parses it (shared/crypto/format.ts): a
  // malformed ciphertext gets the same code from both, and never sends the caller to reload.
  long sealed = decode_base64(s + at, n - at, j->scratch);
  if (sealed < 0) return -1 - E_DECRYPT_FAILED;
  if (version > j->latest) { j->newer = 1; return -1 - E_DECRYPT_FAILED; }
  if (version < j->min_dec) return -1 - E_VERSION_DISABLED;
  version_t found;
  if (!find_version(j, (uint32_t)version, &found) || sealed < NONCE + TAG) return -1 - E_DECRYPT_FAILED;
  const version_t *v = &found;
  size_t ct = (size_t)sealed - NONCE - TAG;
  int len = 0;
  if (!tl_dec_ready) {
    if (!EVP_DecryptInit_ex(j->dec, gcm, NULL, NULL, NULL) || !EVP_CIPHER_CTX_ctrl(j->dec, EVP_CTRL_GCM_SET_IVLEN, NONCE, NULL)) return -1 - E_DECRYPT_FAILED;
    tl_dec_ready = 1;
  }
  if (!tl_dec_keyed || memcmp(tl_dec_key, v->key, KEY) != 0) {
    if (!EVP_DecryptInit_ex(j->dec, NULL, NULL, v->key, NULL)) { tl_dec_keyed = 0; return -1 - E_DECRYPT_FAILED; }
    memcpy(tl_dec_key, v->key, KEY);
    tl_dec_keyed = 1;
  }
  uint8_t *plain = j->scratch + sealed;  // after the sealed bytes
  if (!EVP_DecryptInit_ex(j->dec, NULL, NULL, NULL, j->scratch)) return -1 - E_DECRYPT_FAILED;
  if (!EVP_DecryptUpdate(j->dec, NULL, &len, v->aad, (int)v->aad_len)) return -1 - E_DECRYPT_FAILED;
  if (ct && !EVP_DecryptUpdate(j->dec, plain, &len, j->scratch + NONCE, (int)ct)) return -1 - E_DECRYPT_FAILED;
  if (!EVP_CIPHER_CTX_ctrl(j->dec, EVP_CTRL_GCM_SET_TAG, TAG, j->scratch + NONCE + ct)) return -1 - E_DECRYPT_FAILED;
  if (EVP_DecryptFinal_ex(j->dec, plain + ct, &len) <= 0) return -1 - E_DECRYPT_FAILED;
  memmove(j->scratch, plain, ct);
  return (long)ct;
}

// ---- N-API glue --------------------------------------------------------------------------

#define CHECK(call) do { if ((call) != napi_ok) { napi_throw_error(env, NULL, "keyfleet kernel: N-API call failed: " #call); return NULL; } } while (0)

static napi_value throw_msg(napi_env env, const char *msg) {
  napi_throw_error(env, "KF_KERNEL", msg);
  return NULL;
}

// A typed array of the given element type; its data and its length in elements.
static int typed(napi_env env, napi_value v, napi_typedarray_type want, void **data, size_t *len) {
  bool is;
  napi_typedarray_type type;
  size_t off;
  napi_value ab;
  return napi_is_typedarray(env, v, &is) == napi_ok && is && napi_get_typedarray_info(env, v, &type, len, data, &ab, &off) == napi_ok && type == want;
}

static int typed_u8(napi_env env, napi_value v, uint8_t **data, size_t *len) {
  return typed(env, v, napi_uint8_array, (void **)data, len);
}

// A Uint32Array of exactly `n` elements.
static int typed_u32(napi_env env, napi_value v, size_t n, uint32_t **data) {
  size_t len;
  return typed(env, v, napi_uint32_array, (void **)data, &len) && len == n;
}

// The arguments of formatResults and packLines: (in: Uint8Array, out: Uint8Array, state: Uint32Array(state_len)).
static int buffers_and_state(napi_env env, napi_callback_info info, uint8_t **in, size_t *in_len, uint8_t **out, size_t *out_len, size_t state_len, uint32_t **state) {
  size_t argc = 3;
  napi_value argv[3];
  return napi_get_cb_info(env, info, &argc, argv, NULL, NULL) == napi_ok && argc == 3 && typed_u8(env, argv[0], in, in_len) &&
         typed_u8(env, argv[1], out, out_len) && typed_u32(env, argv[2], state_len, state);
}

// setErrors([json of KF_INVALID_ITEM, KF_ITEM_TOO_LARGE, KF_DECRYPT_FAILED, KF_KEY_VERSION_DISABLED, KF_NOT_UTF8, KF_INVALID_ENCODING])
// The table is process-wide and every thread that loads the addon calls this: the first call
// fills it, under a lock, and later ones leave it be (the catalogue does not change), so no
// thread frees a string another may be writing out.
static pthread_mutex_t errors_lock = PTHREAD_MUTEX_INITIALIZER;

static napi_value set_errors(napi_env env, napi_callback_info info) {
  size_t argc = 1;
  napi_value argv[2];
  CHECK(napi_get_cb_info(env, info, &argc, argv, NULL, NULL));
  pthread_mutex_lock(&errors_lock);
  for (uint32_t i = 0; i < E_COUNT && !error_json[E_COUNT - 1]; i++) {
    napi_value s;
    size_t len;
    char *copy = NULL;
    if (napi_get_element(env, argv[0], i, &s) != napi_ok || napi_get_value_string_utf8(env, s, NULL, 0, &len) != napi_ok ||
        !(copy = malloc(len + 1)) || napi_get_value_string_utf8(env, s, copy, len + 1, &len) != napi_ok) {
      free(copy);
      pthread_mutex_unlock(&errors_lock);
      return throw_msg(env, "setErrors: expected an array of strings");
    }
    free(error_json[i]); // only a partly filled table from a failed call
    error_json[i] = copy;
    error_len[i] = len;
  }
  pthread_mutex_unlock(&errors_lock);
  return NULL;
}

// run(params, versions, input, output) → [bytesWritten, count, succeeded, failed, newerVersionSeen]
// params: Uint32Array [op, base64Out, base64In, json, maxItemBytes, latest, minDecryptionVersion]
// versions: Uint8Array, the key's versions packed (job_t.versions)
static napi_value run(napi_env env, napi_callback_info info) {
  size_t argc = 4;
  napi_value argv[4];
  CHECK(napi_get_cb_info(env, info, &argc, argv, NULL, NULL));
  if (argc != 4) return throw_msg(env, "run(params, versions, input, output): expected 4 arguments");
  if (!error_json[E_COUNT - 1]) return throw_msg(env, "setErrors must be called first");

  job_t j;
  memset(&j, 0, sizeof j);
  // Scalars travel as one Uint32Array (one N-API call instead of seven property reads).
  uint32_t *params;
  if (!typed_u32(env, argv[0], 7, &params))
    return throw_msg(env, "run: params must be a Uint32Array of [op, base64Out, base64In, json, maxItemBytes, latest, minDecryptionVersion]");
  uint32_t op = params[0], b64 = params[1], b64in = params[2], json = params[3], maxItem = params[4], latest = params[5], minDec = params[6];
  if (op > OP_REWRAP) return throw_msg(env, "run: unknown op");
  j.op = (int)op; j.base64_out = (int)b64; j.base64_in = (int)b64in; j.json = (int)json; j.max_item = maxItem; j.latest = latest; j.min_dec = minDec;

  uint8_t *versions;
  size_t versions_len;
  if (!typed_u8(env, argv[1], &versions, &versions_len) || versions_len < 8)
    return throw_msg(env, "run: versions must be a Uint8Array of packed key versions (packVersions)");
  j.versions = versions;
  j.nversions = get_u32le(versions);
  j.stride = get_u32le(versions + 4);
  if (j.nversions == 0 || j.stride < 8 + KEY || j.nversions > (versions_len - 8) / j.stride || versions_len - 8 != j.nversions * j.stride)
    return throw_msg(env, "run: versions must hold [count][stride] and count entries of stride bytes, each at least 40");
  if (!find_version(&j, j.latest, &j.latest_v)) return throw_msg(env, "run: versions must hold the latest version");

  uint8_t *in, *outp;
  size_t in_len, out_len;
  if (!typed_u8(env, argv[2], &in, &in_len)) return throw_msg(env, "run: input must be a Uint8Array");
  if (!typed_u8(env, argv[3], &outp, &out_len)) return throw_msg(env, "run: output must be a Uint8Array");

  // First pass: validate the framing, count items and the largest one.
  size_t count = 0, largest = 0, at = 0;
  while (at < in_len) {
    if (at + 5 > in_len) return throw_msg(env, "corrupt chunk: header truncated");
    uint32_t len = (uint32_t)in[at + 1] | ((uint32_t)in[at + 2] << 8) | ((uint32_t)in[at + 3] << 16) | ((uint32_t)in[at + 4] << 24);
    if (len > in_len - at - 5) return throw_msg(env, "corrupt chunk: item truncated");
    if (len > largest) largest = len;
    at += 5 + (size_t)len;
    count++;
  }

  if (!gcm) gcm = EVP_CIPHER_fetch(NULL, "AES-256-GCM", NULL);
  if (!tl_enc) tl_enc = EVP_CIPHER_CTX_new();
  if (!tl_dec) tl_dec = EVP_CIPHER_CTX_new();
  j.enc = tl_enc;
  j.dec = tl_dec;
  // One scratch area: decoded input and plaintext, then the sealed output.
  size_t scratch_len = 2 * largest + 2 * NONCE + 2 * TAG + 64;
  size_t seal_len = largest + NONCE + TAG + 16;
  uint8_t *area = scratch_of(scratch_len + seal_len);
  j.scratch = area;
  uint8_t *sealbuf = area ? area + scratch_len : NULL;
  const version_t *latest_v = &j.latest_v;
  int ok = gcm && j.enc && j.dec && area;
  if (ok && !tl_enc_ready) {
    ok = EVP_EncryptInit_ex(j.enc, gcm, NULL, NULL, NULL) && EVP_CIPHER_CTX_ctrl(j.enc, EVP_CTRL_GCM_SET_IVLEN, NONCE, NULL);
    tl_enc_ready = ok;
  }
  if (ok && j.op != OP_DECRYPT && (!tl_enc_keyed || memcmp(tl_enc_key, latest_v->key, KEY) != 0)) {
    ok = EVP_EncryptInit_ex(j.enc, NULL, NULL, latest_v->key, NULL);
    tl_enc_keyed = ok;
    if (ok) memcpy(tl_enc_key, latest_v->key, KEY);
  }
  out_t o = {outp, 0, out_len, 0};

  at = 0;
  for (size_t n = 0; ok && n < count && !o.overflow; n++) {
    uint8_t flag = in[at];
    uint32_t len = (uint32_t)in[at + 1] | ((uint32_t)in[at + 2] << 8) | ((uint32_t)in[at + 3] << 16) | ((uint32_t)in[at + 4] << 24);
    const uint8_t *item = in + at + 5;
    at += 5 + (size_t)len;
    if (flag != ITEM_OK) { fail_item(&j, &o, flag == ITEM_NOT_STRING ? E_INVALID_ITEM : E_ITEM_TOO_LARGE); continue; }
    if (len > j.max_item) { fail_item(&j, &o, E_ITEM_TOO_LARGE); continue; }
    if (j.op == OP_ENCRYPT) {
      if (j.base64_in) {
        long plain = decode_base64(item, len, j.scratch);
        if (plain < 0) { fail_item(&j, &o, E_INVALID_ENCODING); continue; }
        item = j.scratch;
        len = (uint32_t)plain;
      }
      size_t sealed = seal(&j, item, len, sealbuf);
      if (!sealed) { ok = 0; break; }
      put_ciphertext(&j, &o, sealbuf, sealed);
      j.succeeded++;
      continue;
    }
    long pt = open_item(&j, item, len);
    if (pt < 0) { fail_item(&j, &o, (int)(-1 - pt)); continue; }
    if (j.op == OP_REWRAP) {
      size_t sealed = seal(&j, j.scratch, (size_t)pt, sealbuf);
      if (!sealed) { ok = 0; break; }
      put_ciphertext(&j, &o, sealbuf, sealed);
    } else {
      if (!j.base64_out && !valid_utf8(j.scratch, (size_t)pt)) { fail_item(&j, &o, E_NOT_UTF8); continue; }
      put_plaintext(&j, &o, j.scratch, (size_t)pt);
    }
    j.succeeded++;
  }

  // Plaintexts passed through the scratch area: wipe what this call used.
  if (area) OPENSSL_cleanse(area, scratch_len + seal_len);
  if (!ok) return throw_msg(env, "keyfleet kernel: OpenSSL failure");
  if (o.overflow) return throw_msg(env, "keyfleet kernel: output buffer too small");

  napi_value result, v;
  CHECK(napi_create_array_with_length(env, 5, &result));
  CHECK(napi_create_double(env, (double)o.at, &v)); CHECK(napi_set_element(env, result, 0, v));
  CHECK(napi_create_double(env, (double)count, &v)); CHECK(napi_set_element(env, result, 1, v));
  CHECK(napi_create_uint32(env, j.succeeded, &v)); CHECK(napi_set_element(env, result, 2, v));
  CHECK(napi_create_uint32(env, j.failed, &v)); CHECK(napi_set_element(env, result, 3, v));
  CHECK(napi_get_boolean(env, j.newer, &v)); CHECK(napi_set_element(env, result, 4, v));
  return result;
}

// ---- result lines ----------------------------------------------------------------------

// formatResults(records, out, state): state is a Uint32Array [at, index, written]. Turns the
// records from byte `at` on into NDJSON result lines numbered from `index`, written to out from
// 0, for as long as the next line surely fits; then at = the next record, index = its number,
// written = the bytes written. A record no line of which fits in an empty out is left for the
// caller to retry with a bigger one (it needs at most 48 + the longest error + 6 × its length).
static napi_value format_results(napi_env env, napi_callback_info info) {
  uint8_t *in, *outp;
  size_t in_len, out_len;
  uint32_t *st;
  if (!buffers_and_state(env, info, &in, &in_len, &outp, &out_len, 3, &st))
    return throw_msg(env, "formatResults(records, out, state): records and out must be Uint8Arrays, state a Uint32Array(3)");
  if (!error_json[E_COUNT - 1]) return throw_msg(env, "setErrors must be called first");
  size_t longest_error = 0;
  for (int e = 0; e < E_COUNT; e++) if (error_len[e] > longest_error) longest_error = error_len[e];
  size_t at = st[0];
  uint32_t index = st[1];
  if (at > in_len) return throw_msg(env, "formatResults: at out of bounds");
  out_t o = {outp, 0, out_len, 0};
  while (at < in_len) {
    if (in_len - at < 5) return throw_msg(env, "corrupt results: record header truncated");
    uint8_t kind = in[at];
    uint32_t len = (uint32_t)in[at + 1] | ((uint32_t)in[at + 2] << 8) | ((uint32_t)in[at + 3] << 16) | ((uint32_t)in[at + 4] << 24);
    if (len > in_len - at - 5) return throw_msg(env, "corrupt results: record truncated");
    if (48 + longest_error + 6 * (size_t)len > out_len - o.at) break;
    const uint8_t *p = in + at + 5;
    put(&o, "{\"i\":", 5); put_uint(&o, index); putc_(&o, ',');
    switch (kind) {
      case R_CIPHERTEXT:
        if (len < 4) return throw_msg(env, "corrupt results: ciphertext record too short");
        put_ciphertext_field(&o, (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24), p + 4, len - 4);
        break;
      case R_PLAINTEXT_UTF8:
      case R_PLAINTEXT_BASE64:
        put_plaintext_field(&o, kind == R_PLAINTEXT_BASE64, p, len);
        break;
      case R_ERROR:
        if (len != 1 || p[0] >= E_COUNT) return throw_msg(env, "corrupt results: unknown error record");
        put(&o, "\"error\":", 8); put(&o, error_json[p[0]], error_len[p[0]]);
        break;
      default:
        return throw_msg(env, "corrupt results: unknown record kind");
    }
    put(&o, "}\n", 2);
    at += 5 + (size_t)len;
    index++;
  }
  if (o.overflow) return throw_msg(env, "formatResults: output buffer too small"); // the bound above rules it out
  st[0] = (uint32_t)at;
  st[1] = index;
  st[2] = (uint32_t)o.at;
  return NULL;
}

// ---- NDJSON upload packing -------------------------------------------------------------

enum { PACK_DONE = 0, PACK_SLOW_LINE = 1, PACK_FULL = 2 };

// Packs the lines of src[start, end) (every line ends in '\n') into out as chunk items, for as
// long as each line is blank or a plain ASCII JSON string: after dropping a trailing CR and
// spaces/tabs at either end, '"' ... '"' with no '"', '\\', byte < 0x20 or >= 0x80 inside. It is
// the fast path of producer/ndjson-items.ts, which handles every other line itself.
// Stops at the first other line (PACK_SLOW_LINE, next = that line's start), after max_items
// items (PACK_FULL), or at end (PACK_DONE). Returns the bytes written to out, or -1 if out
// could not hold the next item (the caller reserves 2 × (end - start), which always does).
static long pack_lines(const uint8_t *src, size_t start, size_t end, uint8_t *out, size_t out_cap, uint32_t max_items, uint32_t max_item, uint32_t *items, size_t *next, uint32_t *reason) {
  size_t at = 0, pos = start;
  uint32_t n = 0;
  *reason = PACK_DONE;
  while (pos < end) {
    if (n >= max_items) { *reason = PACK_FULL; break; }
    const uint8_t *nl = memchr(src + pos, '\n', end - pos);
    if (!nl) break; // a partial line is the caller's
    size_t line_end = (size_t)(nl - src), s = pos, e = line_end;
    if (e > s && src[e - 1] == '\r') e--;
    while (s < e && (src[s] == ' ' || src[s] == '\t')) s++;
    while (e > s && (src[e - 1] == ' ' || src[e - 1] == '\t')) e--;
    if (s == e) { pos = line_end + 1; continue; } // a blank line is no item
    int plain = e - s >= 2 && src[s] == '"' && src[e - 1] == '"';
    for (size_t i = s + 1; plain && i < e - 1; i++) {
      uint8_t b = src[i];
      if (b == '"' || b == '\\' || b < 0x20 || b >= 0x80) plain = 0;
    }
    if (!plain) { *reason = PACK_SLOW_LINE; break; }
    size_t len = e - s - 2;
    int too_large = len > max_item;
    size_t need = 5 + (too_large ? 0 : len);
    if (at + need > out_cap) return -1;
    out[at] = too_large ? ITEM_TOO_LARGE : ITEM_OK;
    uint32_t l32 = too_large ? 0 : (uint32_t)len;
    out[at + 1] = (uint8_t)l32; out[at + 2] = (uint8_t)(l32 >> 8); out[at + 3] = (uint8_t)(l32 >> 16); out[at + 4] = (uint8_t)(l32 >> 24);
    if (!too_large) memcpy(out + at + 5, src + s + 1, len);
    at += need;
    n++;
    pos = line_end + 1;
  }
  *items = n;
  *next = pos;
  return (long)at;
}

// packLines(src, out, state): state is a Uint32Array
// [start, end, outAt, maxItems, maxItemBytes | out: items, next, reason]; items go to out from outAt.
static napi_value pack_lines_js(napi_env env, napi_callback_info info) {
  uint8_t *src, *out;
  size_t src_len, out_len;
  uint32_t *st;
  if (!buffers_and_state(env, info, &src, &src_len, &out, &out_len, 8, &st))
    return throw_msg(env, "packLines(src, out, state): src and out must be Uint8Arrays, state a Uint32Array(8)");
  size_t start = st[0], end = st[1], out_at = st[2];
  if (start > end || end > src_len || out_at > out_len) return throw_msg(env, "packLines: range out of bounds");
  uint32_t items, reason;
  size_t next;
  long written = pack_lines(src, start, end, out + out_at, out_len - out_at, st[3], st[4], &items, &next, &reason);
  if (written < 0) return throw_msg(env, "packLines: output buffer too small");
  st[2] = (uint32_t)(out_at + (size_t)written);
  st[5] = items;
  st[6] = (uint32_t)next;
  st[7] = reason;
  return NULL;
}

// setIdleScheduling(thread) → 0, or the errno: Linux's SCHED_IDLE policy for one thread (0:
// the calling one). Its CPU weight is 3, against 15 at nice 19 and 1024 at nice 0, so it gets a
// much smaller share of a busy core than any niceness gives. Threads it starts later inherit
// the policy. Node can set a niceness (os.setPriority) but not a policy. The system call, not
// libc's wrapper: on Linux it acts on one thread, and musl's wrapper refuses (ENOSYS).
static napi_value set_idle_scheduling(napi_env env, napi_callback_info info) {
  size_t argc = 1;
  napi_value argv[1];
  int32_t thread = 0;
  CHECK(napi_get_cb_info(env, info, &argc, argv, NULL, NULL));
  if (argc < 1 || napi_get_value_int32(env, argv[0], &thread) != napi_ok) return throw_msg(env, "setIdleScheduling(thread): thread must be a thread id");
#if defined(SCHED_IDLE) && defined(SYS_sched_setscheduler)
  struct sched_param param = {0};
  int rc = syscall(SYS_sched_setscheduler, (pid_t)thread, SCHED_IDLE, &param) == 0 ? 0 : errno;
#else
  int rc = ENOSYS;
#endif
  napi_value out;
  CHECK(napi_create_int32(env, rc, &out));
  return out;
}

// tokenIndex(token, digests) → the index of the first 32-byte SHA-256 digest in `digests` (laid
// end to end) that is the token's, or -1. Every digest is compared in full with CRYPTO_memcmp,
// as shared/tokens.ts compares them with timingSafeEqual, so neither where a digest differs
// nor which entry matched shows in the time taken. The same digests as node:crypto's: the
// token's UTF-8 (a lone surrogate as U+FFFD). Why here: Node 20's one-shot hash() fetches
// SHA-256 from OpenSSL's provider on every call (1.2 µs, about 5% of the API's CPU under the
// 10-item sync load); here it is fetched once per thread and the context kept.
// A presented token of more UTF-8 bytes than this is found nowhere, unread: KEYFLEET_TOKENS takes
// tokens of at most MAX_TOKEN_LENGTH (512) ASCII characters (shared/tokens.ts, matchDigest alike).
#define TOKEN_BYTES 512
static __thread EVP_MD *sha256;
static __thread EVP_MD_CTX *tl_md;

static napi_value token_index(napi_env env, napi_callback_info info) {
  size_t argc = 2, digests_len, len = 0;
  napi_value argv[2];
  uint8_t *digests;
  char token[TOKEN_BYTES + 1];
  CHECK(napi_get_cb_info(env, info, &argc, argv, NULL, NULL));
  // Its length first: a string that does not fit is not cut short to be compared (N-API would
  // cut it at a character's edge, anywhere up to the buffer's end).
  if (argc != 2 || !typed_u8(env, argv[1], &digests, &digests_len) || digests_len % 32 != 0 ||
      napi_get_value_string_utf8(env, argv[0], NULL, 0, &len) != napi_ok)
    return throw_msg(env, "tokenIndex(token, digests): token must be a string, digests a Uint8Array of 32-byte digests");
  int32_t found = -1;
  if (len <= TOKEN_BYTES) {
    uint8_t md[32];
    CHECK(napi_get_value_string_utf8(env, argv[0], token, sizeof token, &len));
    if (!sha256) sha256 = EVP_MD_fetch(NULL, "SHA256", NULL);
    if (!tl_md) tl_md = EVP_MD_CTX_new();
    int ok = sha256 && tl_md && EVP_DigestInit_ex(tl_md, sha256, NULL) && EVP_DigestUpdate(tl_md, token, len) && EVP_DigestFinal_ex(tl_md, md, NULL);
    OPENSSL_cleanse(token, len);
    if (!ok) return throw_msg(env, "keyfleet kernel: OpenSSL failure");
    for (size_t i = 0; i < digests_len / 32; i++) {
      if (CRYPTO_memcmp(md, digests + 32 * i, 32) == 0 && found < 0) found = (int32_t)i;
    }
    OPENSSL_cleanse(md, sizeof md);
  }
  napi_value out;
  CHECK(napi_create_int32(env, found, &out));
  return out;
}

NAPI_MODULE_INIT(/* napi_env env, napi_value exports */) {
  napi_property_descriptor props[] = {
    {"setErrors", NULL, set_errors, NULL, NULL, NULL, napi_default, NULL},
    {"run", NULL, run, NULL, NULL, NULL, napi_default, NULL},
    {"formatResults", NULL, format_results, NULL, NULL, NULL, napi_default, NULL},
    {"packLines", NULL, pack_lines_js, NULL, NULL, NULL, napi_default, NULL},
    {"setIdleScheduling", NULL, set_idle_scheduling, NULL, NULL, NULL, napi_default, NULL},
    {"tokenIndex", NULL, token_index, NULL, NULL, NULL, napi_default, NULL},
  };
  if (napi_define_properties(env, exports, sizeof props / sizeof props[0], props) != napi_ok) return NULL;
  return exports;
}
