/*-------------------------------------------------------------------------
 *
 * fingerprint.c
 *	  Request fingerprints and per-key lock hashes.
 *
 * Owns two pure functions of their input: the SHA-256 fingerprint of a
 * request (the UTF-8 bytes of the jsonb text form, which already orders
 * object keys and drops insignificant whitespace) and the 64-bit hash of
 * (scope, key) that names the key's advisory lock.  Must not touch the
 * table or take locks; its only state is OpenSSL's SHA-256 context.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "common/cryptohash.h"
#include "common/hashfn.h"
#include "lib/stringinfo.h"
#include "utils/jsonb.h"

#ifdef USE_OPENSSL
#include <openssl/evp.h>
#endif

#include "idempotency.h"

/* Seed of the lock hash; any constant works, it only has to stay put. */
#define IDEM_HASH_SEED	UINT64CONST(0x1de4707e5c0ffee5)

/*
 * SHA-256 of a buffer.  With OpenSSL (as PostgreSQL is built wherever it
 * matters) the digest is fetched once per backend and one EVP context is
 * reused: pg_cryptohash_create allocates a context, registers it with the
 * resource owner and has OpenSSL look the digest up by name on every call,
 * which costs more than the hashing itself on a replay.  EVP keeps the
 * hashing inside OpenSSL's providers, so a FIPS configuration still
 * applies.  Elsewhere PostgreSQL's own implementation is used as is.
 */
#ifdef USE_OPENSSL
static EVP_MD_CTX *sha256_ctx = NULL;
static const EVP_MD *sha256_md = NULL;

static void
sha256(const char *data, size_t len, uint8 *out)
{
	unsigned int outlen = 0;

	if (sha256_md == NULL)
	{
#if OPENSSL_VERSION_NUMBER >= 0x30000000L
		sha256_md = EVP_MD_fetch(NULL, "SHA256", NULL);
#else
		sha256_md = EVP_sha256();
#endif
		if (sha256_md == NULL)
			elog(ERROR, "could not load SHA-256 from OpenSSL");
	}
	if (sha256_ctx == NULL)
	{
		sha256_ctx = EVP_MD_CTX_create();
		if (sha256_ctx == NULL)
			ereport(ERROR,
					(errcode(ERRCODE_OUT_OF_MEMORY),
					 errmsg("out of memory")));
	}
	if (EVP_DigestInit_ex(sha256_ctx, sha256_md, NULL) != 1 ||
		EVP_DigestUpdate(sha256_ctx, data, len) != 1 ||
		EVP_DigestFinal_ex(sha256_ctx, out, &outlen) != 1 ||
		outlen != IDEM_FINGERPRINT_LEN)
		elog(ERROR, "could not compute SHA-256 request fingerprint");
}
#else
static void
sha256(const char *data, size_t len, uint8 *out)
{
	pg_cryptohash_ctx *ctx = pg_cryptohash_create(PG_SHA256);

	if (ctx == NULL)
		ereport(ERROR,
				(errcode(ERRCODE_OUT_OF_MEMORY),
				 errmsg("out of memory")));
	if (pg_cryptohash_init(ctx) < 0 ||
		pg_cryptohash_update(ctx, (const uint8 *) data, len) < 0 ||
		pg_cryptohash_final(ctx, out, IDEM_FINGERPRINT_LEN) < 0)
		elog(ERROR, "could not compute SHA-256 request fingerprint: %s",
			 pg_cryptohash_error(ctx));
	pg_cryptohash_free(ctx);
}
#endif

/*
 * SHA-256 over the text form of a jsonb value.  Two requests match only
 * when their canonical texts are byte-for-byte equal (so 100 and 100.0
 * differ: jsonb keeps numeric scale).
 */
void
idem_fingerprint(Datum jsonb, uint8 *out)
{
	Jsonb	   *jb = DatumGetJsonbP(jsonb);
	StringInfoData buf;

	initStringInfo(&buf);
	JsonbToCString(&buf, &jb->root, VARSIZE(jb));
	sha256(buf.data, buf.len, out);
	pfree(buf.data);
	if ((Pointer) jb != DatumGetPointer(jsonb))
		pfree(jb);
}

/*
 * 64-bit hash of (scope, key).  The scope's length is mixed in first, so
 * ("ab", "c") and ("a", "bc") hash differently.  Never 0: wait.c uses 0
 * for "no key".
 */
uint64
idem_key_hash(text *scope, text *key)
{
	uint32		scope_len = VARSIZE_ANY_EXHDR(scope);
	uint64		h;

	h = hash_bytes_extended((const unsigned char *) &scope_len,
							sizeof(scope_len), IDEM_HASH_SEED);
	h = hash_bytes_extended((const unsigned char *) VARDATA_ANY(scope),
							scope_len, h);
	h = hash_bytes_extended((const unsigned char *) VARDATA_ANY(key),
							VARSIZE_ANY_EXHDR(key), h);
	return h == 0 ? 1 : h;
}
