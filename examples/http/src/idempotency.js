'use strict';
/*
 * idempotency.js: an Express middleware for the "Idempotency-Key" HTTP header
 * (IETF draft-ietf-httpapi-idempotency-key-header) on top of the idempotency
 * PostgreSQL extension.  The database keeps every key's state; this file only
 * maps the extension's four claim outcomes to HTTP:
 *
 *   claimed     run the handler, then idem_finish (or idem_release)
 *   replay      the stored status and body, with "Idempotent-Replayed: true"
 *   in_progress 409 Conflict with "Retry-After: <retry_after>"
 *   mismatch    422 Unprocessable Content (same key, different request)
 *
 * Two modes:
 *
 *   external(handler)       for side effects outside the database (an HTTP
 *       call to a payment processor).  The claim commits on its own (autocommit),
 *       the handler runs, a heartbeat extends the lease while it runs, and the
 *       result is stored with idem_finish in a later statement, on whatever pool
 *       connection is free: no session state spans claim and finish, so this works
 *       through PgBouncer in transaction pooling mode.  A handler result with a
 *       5xx status, or a thrown error, releases the key (the retry runs again);
 *       a 4xx result is stored as status 'failed' and replayed.
 *       This is AT LEAST ONCE for the external call: a process that dies after
 *       the call but before the finish leaves a pending key, and after the lease
 *       the next retry takes it over (attempt + 1, a larger fencing token) and
 *       calls again.  The handler must therefore pass the key and the token on,
 *       so that the downstream can dedupe by key and refuse smaller tokens.
 *
 *   transactional(handler)  for side effects in this database.  BEGIN, claim,
 *       the handler's writes on the same client, finish, COMMIT.  All or nothing:
 *       a handler that throws rolls back its writes and the claim together, so no
 *       trace of the key is left.  This is EXACTLY ONCE for the writes (within the
 *       key's retention).
 *
 * A handler is `async (req, ctx) => ({ status, body })`; ctx carries key, scope,
 * token, attempt (attempt > 1: an earlier attempt may have run partly) and, in
 * transactional mode, the pg client of the open transaction.
 */

const MAX_KEY_LENGTH = 255;     /* the extension's limit (SQLSTATE 22001 above it) */

/* SQLSTATEs this file reacts to (the README of the extension lists them all) */
const SQLSTATE = {
	stringTooLong: '22001',
	nullValue: '22004',
	invalidParameter: '22023',
	noSuchKey: 'P0002',
	finishedByOther: '55000',
	deadToken: '55006',
	keyBusy: '55P03',
	responseTooLarge: '54000',
	readOnly: '25006',
	serialization: '40001',
};

/*
 * The claim.  The request fingerprint covers method, path and the raw JSON body
 * (parsed by PostgreSQL as jsonb: key order and whitespace do not matter,
 * numeric scale does, so 100 and 100.0 are different requests).  The stored
 * body comes back as jsonb's text form, the very bytes the first answer sent.
 */
const CLAIM_SQL = `
SELECT outcome, token, attempt, status, response_code,
       response_body::text AS response_body, retry_after
  FROM idempotency.idem_claim(
         key       => $1,
         request   => pg_catalog.jsonb_build_object('method', $2::text,
                                                    'path',   $3::text,
                                                    'body',   $4::jsonb),
         scope     => $5,
         lease     => $6::interval,
         retention => $7::interval)`;

/* finish returns the body as the same jsonb text a later replay will send */
const FINISH_SQL = `
SELECT idempotency.idem_finish(key           => $1,
                               token         => $2,
                               response_code => $3,
                               response_body => $4::jsonb,
                               scope         => $5,
                               status        => $6) AS expires_at,
       $4::jsonb::text AS response_body`;

const RELEASE_SQL = `SELECT idempotency.idem_release(key => $1, token => $2, scope => $3)`;

const EXTEND_SQL = `SELECT idempotency.idem_extend(key => $1, token => $2,
                                                   lease => $3::interval, scope => $4)`;

/*
 * Parse an Idempotency-Key header value.  The draft makes it a Structured
 * Field String (RFC 8941): "8e03978e-40d5-43e8-bc93-6894a57f9324" with quotes.
 * Many clients send the bare value, so a value that does not start with a quote
 * is taken as it is.  Returns { missing } | { error } | { key }.
 */
function parseIdempotencyKey(raw) {
	if (raw === undefined)
		return { missing: true };
	let value = raw.trim();
	if (value.startsWith('"')) {
		let out = '';
		let i = 1;
		for (; i < value.length; i++) {
			const c = value[i];
			if (c === '\\') {
				const next = value[i + 1];
				if (next !== '"' && next !== '\\')
					return { error: 'The Idempotency-Key string contains an invalid escape.' };
				out += next;
				i++;
			} else if (c === '"') {
				break;
			} else {
				const code = c.charCodeAt(0);
				if (code < 0x20 || code > 0x7e)
					return { error: 'The Idempotency-Key string may contain printable ASCII characters only.' };
				out += c;
			}
		}
		if (i >= value.length)
			return { error: 'The Idempotency-Key string has no closing quote.' };
		const rest = value.slice(i + 1).trim();
		/* Structured Field parameters (";a=1") are allowed and ignored */
		if (rest !== '' && !rest.startsWith(';'))
			return { error: 'Send exactly one Idempotency-Key header, holding one string.' };
		value = out;
	}
	if (value.length === 0)
		return { error: 'The Idempotency-Key header is empty.' };
	const length = [...value].length;      /* characters, as PostgreSQL counts them */
	if (length > MAX_KEY_LENGTH)
		return {
			error: `The Idempotency-Key is ${length} characters long; ` +
				`the limit is ${MAX_KEY_LENGTH} characters.`,
		};
	return { key: value };
}

/* a response's content type: problem details for errors, JSON otherwise */
function contentTypeFor(status) {
	return status >= 400 ? 'application/problem+json' : 'application/json';
}

/* send a stored or fresh result: same status, same type, same body bytes */
function sendResult(res, status, bodyText, replayed) {
	res.status(status);
	if (replayed)
		res.set('Idempotent-Replayed', 'true');
	if (bodyText === null || bodyText === undefined)
		return res.end();
	res.type(contentTypeFor(status));
	return res.send(bodyText);
}

function sleep(ms) {
	return new Promise((resolve) => setTimeout(resolve, ms));
}

/* a lost connection or a transient "key busy": worth one more try */
function isTransient(err) {
	return err.code === SQLSTATE.keyBusy ||
		err.code === SQLSTATE.serialization ||
		err.code === undefined ||                   /* socket errors: ECONNRESET... */
		/^(ECONN|EPIPE|ETIMEDOUT)/.test(String(err.code));
}

/* this attempt no longer owns the key: taken over, reset, or settled by another */
function isLostClaim(err) {
	return err.code === SQLSTATE.deadToken ||
		err.code === SQLSTATE.finishedByOther ||
		err.code === SQLSTATE.noSuchKey;
}

/*
 * createIdempotency(options) -> { external, transactional, parseIdempotencyKey }
 *
 *   pool            a pg.Pool (required)
 *   required        a request without the header is refused with 400 (default true)
 *   scope(req)      the key's scope: a tenant or client id (default '')
 *   leaseMs         lease of a claim (default 30 s); the heartbeat extends it
 *                   every leaseMs / 3 while an external handler runs
 *   retention       how long results are kept, a PostgreSQL interval
 *                   (default: the server's idempotency.retention)
 *   problemTypeBase prefix of the RFC 9457 "type" URIs
 *   log             a function for unexpected errors (default console.error)
 */
function createIdempotency(options) {
	const pool = options.pool;
	if (!pool)
		throw new TypeError('createIdempotency needs a pg pool');
	const required = options.required ?? true;
	const scopeOf = options.scope ?? (() => '');
	const leaseMs = options.leaseMs ?? 30000;
	const lease = `${leaseMs} milliseconds`;
	const retention = options.retention ?? null;
	const typeBase = options.problemTypeBase ?? 'https://example.com/problems/';
	const log = options.log ?? ((...args) => console.error(...args));

	/* an RFC 9457 problem-details response */
	function problem(res, status, type, title, detail, headers = {}) {
		res.status(status).set(headers).type('application/problem+json');
		return res.send(JSON.stringify({ type: typeBase + type, title, status, detail }));
	}

	/* errors of the database calls themselves: never leak their text for 5xx */
	function databaseProblem(res, err) {
		switch (err.code) {
			case SQLSTATE.stringTooLong:
				return problem(res, 400, 'idempotency-key-too-long',
					'Idempotency-Key or scope too long',
					`Idempotency keys and scopes are limited to ${MAX_KEY_LENGTH} characters.`);
			case SQLSTATE.nullValue:
			case SQLSTATE.invalidParameter:
				return problem(res, 400, 'idempotency-key-invalid',
					'Invalid Idempotency-Key', err.message);
			case SQLSTATE.readOnly:
			case SQLSTATE.serialization:
			case SQLSTATE.keyBusy:
				return problem(res, 503, 'try-again', 'Service briefly unavailable',
					'Please retry this request with the same Idempotency-Key.',
					{ 'Retry-After': '1' });
			default:
				log('idempotency: database error', err);
				return problem(res, 500, 'internal-error', 'Internal server error',
					'The request failed; it is safe to retry with the same Idempotency-Key.');
		}
	}

	function lostClaim(res) {
		return problem(res, 409, 'idempotency-claim-lost', 'Request attempt superseded',
			'This attempt took too long and another attempt with the same ' +
			'Idempotency-Key took over. Retry to get the stored result.',
			{ 'Retry-After': '1' });
	}

	/*
	 * Steps shared by both modes: read the key, or answer 400.  Returns null when
	 * a response has been sent, { key: null } for an optional key that is absent.
	 */
	function readKey(req, res) {
		const parsed = parseIdempotencyKey(req.get('Idempotency-Key'));
		if (parsed.missing) {
			if (!required)
				return { key: null };
			problem(res, 400, 'idempotency-key-missing', 'Idempotency-Key header missing',
				`${req.method} ${req.path} requires an Idempotency-Key header: a unique ` +
				'string of 1 to 255 characters per operation, sent again with every retry.');
			return null;
		}
		if (parsed.error) {
			problem(res, 400, parsed.error.includes('limit') ? 'idempotency-key-too-long'
				: 'idempotency-key-invalid', 'Invalid Idempotency-Key', parsed.error);
			return null;
		}
		return { key: parsed.key };
	}

	function claimParams(req, key) {
		return [key, req.method, req.originalUrl, req.rawBody ?? null,
			scopeOf(req), lease, retention];
	}

	/* answer every claim outcome except "claimed"; true if it answered */
	function answerOutcome(res, claim) {
		switch (claim.outcome) {
			case 'claimed':
				return false;
			case 'replay':
				sendResult(res, claim.response_code ?? 200, claim.response_body, true);
				return true;
			case 'in_progress':
				problem(res, 409, 'idempotency-key-in-use', 'Request already in progress',
					'A request with the same Idempotency-Key is still being processed. ' +
					'Retry after the delay in Retry-After to get its result.',
					{ 'Retry-After': String(claim.retry_after ?? 1) });
				return true;
			case 'mismatch':
				problem(res, 422, 'idempotency-key-reused',
					'Idempotency-Key reused with a different request',
					'This Idempotency-Key was already used for a different request ' +
					'(method, path or body). Use a new key for a new operation.');
				return true;
			default:
				throw new Error(`unexpected claim outcome ${claim.outcome}`);
		}
	}

	/* normalise what a handler returned */
	function resultOf(value) {
		const status = value?.status ?? 200;
		const body = value?.body === undefined ? null : value.body;
		return { status, bodyJson: body === null ? null : JSON.stringify(body) };
	}

	/* run a statement, retrying a lost connection or a busy key a few times */
	async function queryWithRetry(sql, params) {
		for (let attempt = 0; ; attempt++) {
			try {
				return await pool.query(sql, params);
			} catch (err) {
				if (attempt >= 4 || !isTransient(err))
					throw err;
				await sleep(50 * 2 ** attempt);
			}
		}
	}

	/*
	 * Keep a claim alive while a long handler runs: idem_extend every lease / 3.
	 * stop() waits for a heartbeat in flight, so that it never races the finish
	 * (a finish during an extend of the same key raises 55P03).
	 */
	function startHeartbeat(ctx) {
		const every = Math.max(50, Math.floor(leaseMs / 3));
		let stopped = false;
		let timer = null;
		let inflight = Promise.resolve();
		const beat = () => {
			inflight = pool.query(EXTEND_SQL, [ctx.key, ctx.token, lease, ctx.scope])
				.catch((err) => {
					if (isLostClaim(err))
						ctx.leaseLost = true;
				})
				.finally(() => {
					if (!stopped && !ctx.leaseLost)
						timer = setTimeout(beat, every);
				});
		};
		timer = setTimeout(beat, every);
		return {
			async stop() {
				stopped = true;
				clearTimeout(timer);
				await inflight;
			},
		};
	}

	/* give the key up; true if we still owned it */
	async function release(ctx) {
		try {
			await queryWithRetry(RELEASE_SQL, [ctx.key, ctx.token, ctx.scope]);
			return true;
		} catch (err) {
			if (isLostClaim(err))
				return false;
			log('idempotency: release failed; the key frees itself after its lease', err);
			return true;
		}
	}

	/* external-call mode: claim, run, finish in separate statements */
	function external(handler) {
		return async function idempotentExternal(req, res) {
			const k = readKey(req, res);
			if (k === null)
				return;
			if (k.key === null) {
				const r = resultOf(await handler(req, { key: null }));
				return sendResult(res, r.status, r.bodyJson, false);
			}

			let claim;
			try {
				claim = (await pool.query(CLAIM_SQL, claimParams(req, k.key))).rows[0];
			} catch (err) {
				return databaseProblem(res, err);
			}
			if (answerOutcome(res, claim))
				return;

			const ctx = {
				key: k.key, scope: scopeOf(req), token: claim.token,
				attempt: claim.attempt, leaseLost: false,
			};
			const heartbeat = startHeartbeat(ctx);
			let r;
			try {
				r = resultOf(await handler(req, ctx));
			} catch (err) {
				await heartbeat.stop();
				if (!(await release(ctx)) || ctx.leaseLost)
					return lostClaim(res);
				if (err.problem)
					return problem(res, err.problem.status, err.problem.type,
						err.problem.title, err.problem.detail, err.problem.headers);
				log('idempotency: handler failed; key released', err);
				return problem(res, 500, 'internal-error', 'Internal server error',
					'The request failed and was not recorded; retry with the same Idempotency-Key.');
			}
			await heartbeat.stop();

			if (r.status >= 500) {
				/* transient: nothing stored, the next retry runs the operation again */
				if (!(await release(ctx)))
					return lostClaim(res);
				return sendResult(res, r.status, r.bodyJson, false);
			}
			try {
				const fin = await queryWithRetry(FINISH_SQL, [
					ctx.key, ctx.token, r.status, r.bodyJson, ctx.scope,
					r.status >= 400 ? 'failed' : 'succeeded']);
				return sendResult(res, r.status, fin.rows[0].response_body, false);
			} catch (err) {
				if (isLostClaim(err))
					return lostClaim(res);
				if (err.code === SQLSTATE.responseTooLarge) {
					await release(ctx);
					log('idempotency: response too large to store; key released', err);
					return problem(res, 500, 'internal-error', 'Internal server error',
						'The result could not be recorded.');
				}
				return databaseProblem(res, err);
			}
		};
	}

	/* in-transaction mode: BEGIN; claim; handler's writes; finish; COMMIT */
	function transactional(handler) {
		return async function idempotentTransactional(req, res) {
			const k = readKey(req, res);
			if (k === null)
				return;
			const client = await pool.connect();
			let broken = null;
			try {
				await client.query('BEGIN');
				if (k.key === null) {
					const r = resultOf(await handler(req, { key: null, client }));
					await client.query('COMMIT');
					return sendResult(res, r.status, r.bodyJson, false);
				}
				const claim = (await client.query(CLAIM_SQL, claimParams(req, k.key))).rows[0];
				if (claim.outcome !== 'claimed') {
					await client.query('ROLLBACK');
					return answerOutcome(res, claim);
				}
				const ctx = {
					key: k.key, scope: scopeOf(req), token: claim.token,
					attempt: claim.attempt, client,
				};
				let r;
				try {
					r = resultOf(await handler(req, ctx));
				} catch (err) {
					/* the rollback takes the claim with it: no trace of the key */
					await client.query('ROLLBACK');
					if (err.problem)
						return problem(res, err.problem.status, err.problem.type,
							err.problem.title, err.problem.detail, err.problem.headers);
					log('idempotency: handler failed; transaction rolled back', err);
					return problem(res, 500, 'internal-error', 'Internal server error',
						'The request failed and was rolled back; retry with the same Idempotency-Key.');
				}
				if (r.status >= 500) {
					await client.query('ROLLBACK');
					return sendResult(res, r.status, r.bodyJson, false);
				}
				const fin = await client.query(FINISH_SQL, [
					ctx.key, ctx.token, r.status, r.bodyJson, ctx.scope,
					r.status >= 400 ? 'failed' : 'succeeded']);
				await client.query('COMMIT');
				return sendResult(res, r.status, fin.rows[0].response_body, false);
			} catch (err) {
				try {
					await client.query('ROLLBACK');
				} catch (rollbackError) {
					broken = rollbackError;     /* do not return a broken client to the pool */
				}
				return databaseProblem(res, err);
			} finally {
				client.release(broken ?? undefined);
			}
		};
	}

	return { external, transactional, parseIdempotencyKey };
}

/* an error a handler may throw to answer with a specific problem */
class HttpProblem extends Error {
	constructor(status, type, title, detail, headers = {}) {
		super(title);
		this.problem = { status, type, title, detail, headers };
	}
}

/* express.json() verify hook: keep the raw body for the fingerprint */
function captureRawBody(req, res, buf) {
	req.rawBody = buf.length > 0 ? buf.toString('utf8') : null;
}

module.exports = {
	createIdempotency, parseIdempotencyKey, captureRawBody, HttpProblem, MAX_KEY_LENGTH,
};
