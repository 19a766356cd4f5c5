// Types of pg-idempotency.  Written by hand; index.d.mts is the same text for
// the ESM entry.  pg is typed structurally (anything with query(), and
// connect() for the transactional mode), so @types/pg is not needed and a
// wrapped pool fits.

/// <reference types="node" />
import type { IncomingMessage, ServerResponse } from 'node:http';

/** The part of a pg result this library reads. */
export interface QueryResultLike {
	rows: any[];
}

/** Anything that runs one statement: a pg.Pool, a pg.Client. */
export interface Queryable {
	query(text: string, values?: unknown[]): Promise<QueryResultLike>;
}

/** A pooled client (pg.PoolClient). */
export interface PoolClientLike extends Queryable {
	release(err?: Error | boolean): void;
}

/** A pg.Pool: query() for autocommit statements, connect() for the transactional mode. */
export interface PoolLike extends Queryable {
	connect(): Promise<PoolClientLike>;
}

/** JSON values as stored in jsonb. */
export type JsonValue = string | number | boolean | null | JsonValue[] | { [key: string]: JsonValue };

/** Durations are numbers of seconds (fractions allowed). */
export type Seconds = number;

// ---------------------------------------------------------------- hooks

/** What a hook is told: the key, its scope and the request (a job's payload, or the HTTP request). */
export interface HookEvent<Req = unknown> {
	key: string;
	scope: string;
	request: Req;
	/** The attempt's fencing token (decimal string) and number, where there is one. */
	token?: string;
	attempt?: number;
}

/**
 * Callbacks that observe each answer (metrics, logs, traces). A hook that throws, or whose
 * promise rejects, is logged and changes no answer; a promise is not waited for.
 */
export interface Hooks<Req = unknown> {
	/** The key was claimed: the work or handler runs now. */
	onClaim?: (event: HookEvent<Req> & { token: string; attempt: number }) => void | Promise<void>;
	/** A stored result is returned (status: 'succeeded' or 'failed' for jobs, the HTTP status for requests). */
	onReplay?: (event: HookEvent<Req> & { status: string | number; cached?: boolean }) => void | Promise<void>;
	/** Another attempt holds the key: InProgressError, or 409 with Retry-After. */
	onConflict?: (event: HookEvent<Req> & { retryAfter: number }) => void | Promise<void>;
	/** The key was used for another request: MismatchError, or 422. */
	onMismatch?: (event: HookEvent<Req>) => void | Promise<void>;
	/**
	 * The key's result has expired but the server remembers it (extension 1.7): ExpiredError,
	 * or 410. status: the key's ('succeeded' or 'failed'); responseCode: the stored HTTP status
	 * (null for a job's key).
	 */
	onExpired?: (event: HookEvent<Req> & { status: 'succeeded' | 'failed'; responseCode: number | null }) => void | Promise<void>;
	/** The store failed or the key was lost (not the application's own errors). */
	onError?: (event: HookEvent<Req> & { error: unknown }) => void | Promise<void>;
}

// ---------------------------------------------------------------- jobs

export interface IdempotentOptions extends Hooks {
	/** The idempotency key (1 to 255 characters), e.g. a message id. */
	key: string;
	/** The request payload; the same key with a different payload throws MismatchError. Omit: no check. */
	request?: unknown;
	/** Tenant, queue or consumer group the key belongs to. Default ''. */
	scope?: string;
	/** How long a claim is protected from takeover; a heartbeat extends it every lease/3. Default 30. */
	lease?: Seconds;
	/** How long the stored result is kept. Default 86400 (24 h). */
	retention?: Seconds;
	/** How long to wait for another attempt in progress before throwing InProgressError. Default 0. */
	wait?: Seconds;
	/** true: release the key and rethrow (the next call runs again); false: store the failure. Default: every error is retryable. */
	retryable?: (err: unknown) => boolean;
	/** Where unexpected heartbeat errors go. Default console.error. */
	log?: (message: string, err?: unknown) => void;
	/**
	 * Tie the claim to the server session that makes it (a pool client held until the
	 * attempt settles): if that session ends (the process died), the next claim takes the
	 * key over at once instead of after the lease. Meaningless behind a transaction pooler
	 * (PgBouncer in transaction mode), where the server session outlives the client. Needs
	 * extension version 1.4. Default false.
	 */
	sessionBound?: boolean;
	/**
	 * Seconds the server remembers the key after its retention (its status, not its result),
	 * so that a call past the retention throws ExpiredError instead of running fn again. Not
	 * set: the server's idempotency.remember (default off). 0: off, whatever the server's
	 * setting. Needs extension version 1.7 (MisconfiguredError before the claim otherwise).
	 */
	remember?: Seconds | null;
	/**
	 * Store the request with the key while it is pending (extension 1.8), so that a completer()
	 * can finish the job from its last recovery point if this process dies. Over the server's
	 * idempotency.max_response_size the claim fails (SQLSTATE 54000). Default false: nothing is
	 * sent, and older extensions keep working; true on an older one throws MisconfiguredError
	 * before the claim.
	 */
	keepRequest?: boolean;
}

export interface CheckpointOptions {
	/**
	 * Run on this client, inside your open transaction, so that the step's writes and the
	 * checkpoint commit together (or neither). Default: committed on its own (in the
	 * transactional HTTP mode: in that transaction).
	 */
	client?: Queryable;
}

/**
 * Record that this attempt completed the step `phase` (e.g. 'charge_created'), with `data`
 * (any JSON value) for the attempt that takes the key over if this one dies. A later
 * checkpoint replaces an earlier one. Rejects with KeyLostError when another attempt owns
 * the key. Needs extension version 1.4.
 */
export type Checkpoint = (phase: string, data?: unknown, options?: CheckpointOptions) => Promise<void>;

/** Where an attempt resumes, and how it records its own progress. */
export interface RecoveryPoint {
	/** The step an earlier attempt completed (its last checkpoint) when this attempt took the key over; null on a first attempt or when none was recorded. Not changed by this attempt's own checkpoints. */
	phase: string | null;
	/** What that checkpoint recorded (a JSON value), or null. */
	phaseData: JsonValue | null;
	checkpoint: Checkpoint;
}

export interface AttemptInfo extends RecoveryPoint {
	key: string;
	scope: string;
	/** Fencing token: larger for every newer attempt; pass it downstream. Decimal string of a bigint. */
	token: string;
	/** 1 for the first attempt; more means an earlier attempt may have run partly. */
	attempt: number;
	/**
	 * The job's payload: options.request of idempotent() as given (null without one), or the
	 * request a completer found stored with the key (as JSON gives it back).
	 */
	request: unknown;
	/** Aborts (with a KeyLostError reason) when the key is lost to a takeover. */
	signal: AbortSignal;
}

/** The options of idempotentJob: those of idempotent(), with key, request and scope computed from the job's arguments. */
export interface IdempotentJobOptions<A extends unknown[]> extends Omit<IdempotentOptions, 'key' | 'request' | 'scope'> {
	/** The key of a call, from its arguments (1 to 255 characters). */
	key: (...args: A) => string | Promise<string>;
	/** The payload checked with the key (a different one throws MismatchError). Default: no check. */
	request?: (...args: A) => unknown;
	/**
	 * The scope: a string, or computed from the arguments. Default: the function's name, so that
	 * two jobs whose arguments give the same key are two operations. '' keeps the unscoped keys
	 * of idempotent(). An anonymous function needs it (TypeError otherwise).
	 */
	scope?: string | ((...args: A) => string | Promise<string>);
}

export type IdempotentResult<T> =
	| { replayed: false; value: T; attempt: number; token: string }
	| { replayed: true; value: Jsonified<T>; attempt: null; token: null };

/** What a value becomes after a JSON round trip (near enough for typing replays). */
export type Jsonified<T> = T extends { toJSON(): infer R }
	? R
	: T extends (...args: any[]) => any
		? never
		: T extends object
			? { [K in keyof T]: Jsonified<T[K]> }
			: T;

/**
 * Run fn at most once per (scope, key) until the key's retention passes; later
 * calls get the stored value (replayed: true) without running fn.
 *
 * @throws InProgressError another attempt holds the key
 * @throws MismatchError the key was used with a different request
 * @throws ExpiredError the key was used, its result has expired and the server remembers it
 * @throws StoredFailureError the key holds a failure stored by a non-retryable error
 * @throws KeyLostError the lease ran out and another attempt took the key over
 */
export function idempotent<T>(
	pool: Queryable,
	options: IdempotentOptions,
	fn: (attempt: AttemptInfo) => T | Promise<T>,
): Promise<IdempotentResult<Awaited<T>>>;

/**
 * fn wrapped so that each call runs it at most once per key (computed from the call's
 * arguments); a later call with the same key resolves to the stored value without
 * running it. Inside fn, currentJob() is the running attempt.
 *
 * @throws TypeError at once: no key function, or an anonymous fn without scope
 */
export function idempotentJob<F extends (...args: any[]) => unknown>(
	pool: Queryable,
	options: IdempotentJobOptions<Parameters<F>>,
	fn: F,
): (...args: Parameters<F>) => Promise<Awaited<ReturnType<F>> | Jsonified<Awaited<ReturnType<F>>>>;

/** The attempt of the idempotentJob running in this async context; undefined outside one. */
export function currentJob(): AttemptInfo | undefined;

// ---------------------------------------------------------------- HTTP

export type StoreDecision = 'succeeded' | 'failed' | 'release';

export interface HttpOptions<Req> extends Hooks<Req> {
	/** The pg pool. The transactional mode needs connect(). */
	pool: PoolLike | Queryable;
	/** The key's scope: tenant or principal, e.g. req.user.id. Never a client-chosen header unless you trust it. Default ''. */
	scope?: (req: Req) => string | Promise<string>;
	/**
	 * The request's key, replacing the Idempotency-Key header: a string, or null/undefined when the
	 * request has none (400 when required, else no idempotency). Empty or with control characters:
	 * 400 malformed; over 255 characters: 400 too-long. Default: the Idempotency-Key header.
	 */
	key?: (req: Req) => string | null | undefined | Promise<string | null | undefined>;
	/** The request fingerprint. Default: {method, path, body_sha256} of the raw body bytes. */
	fingerprint?: (req: Req) => unknown;
	/**
	 * A JSON body (application/json, *\/*+json) is fingerprinted as jsonb: key order, whitespace and
	 * duplicate keys (the last wins) no longer make another request; 1 and 1.0 still do. Default false:
	 * byte-exact, the stricter promise, and keys stored before stay valid.
	 */
	canonicalJson?: boolean;
	/**
	 * Largest request body of a covered request, in bytes; over it: 413, the key unused
	 * (also with a fingerprint option). null or 0: no limit. Default 1048576.
	 */
	maxBodySize?: number | null;
	/** Methods covered. Default ['POST', 'PATCH']. */
	methods?: string[];
	/** Refuse a covered request without the header (400). Default true. */
	required?: boolean;
	/** Lease of a claim; the heartbeat extends it every lease/3. Default 30. */
	lease?: Seconds;
	/** How long results are kept; sent as Idempotency-Key-Retention. Default 86400. */
	retention?: Seconds;
	/**
	 * Seconds the server remembers a key after its retention (its status and response code, not
	 * the body): a retry in that time gets 410 idempotency-key-expired instead of running the
	 * handler again. Not set: the server's idempotency.remember (default off). 0: off, whatever
	 * the server's setting. Needs extension version 1.7: older ones answer 500
	 * idempotency-misconfigured naming it. Fastify routes can set their own.
	 */
	remember?: Seconds | null;
	/**
	 * Store the request with the key while it is pending (extension 1.8), so that a completer()
	 * (kind 'http') can finish it if this process dies. The stored request is also what the
	 * fingerprint hashes: {method, path, body} with a JSON body compared as jsonb (as with
	 * canonicalJson), {method, path, body_base64} for any other body, or what fingerprint()
	 * returns. A request over the server's idempotency.max_response_size gets 413. Older
	 * extensions answer 500 idempotency-misconfigured naming the version. Default false.
	 * Fastify routes can set their own.
	 */
	keepRequest?: boolean;
	/** What a response status does to the key. Default: defaultStorePolicy. Overrides storeServerErrors. */
	storePolicy?: (status: number) => StoreDecision;
	/** Store a 5xx the handler sends as failed (replayed) instead of releasing the key. A thrown error still releases. Default false. */
	storeServerErrors?: boolean;
	/**
	 * Transactional mode: what a stored failure (4xx, or 5xx with storeServerErrors) does to the
	 * handler's writes. 'commit': they commit with the stored response; 'rollback': they are rolled
	 * back (to a savepoint after the claim) and only the response is stored. Default 'commit'.
	 */
	failedWrites?: 'commit' | 'rollback';
	/**
	 * Response headers stored and replayed, added to content-type, content-encoding,
	 * content-language, location, etag, last-modified (any case). Framing headers
	 * (transfer-encoding, content-length, connection, ...) are never stored.
	 */
	storeHeaders?: string[];
	/** Most seconds a 409 in-progress answer asks a client to wait (Retry-After). Default 5. */
	retryAfterMax?: Seconds;
	/**
	 * Seconds a duplicate that arrives while the original runs waits for the original's answer:
	 * it gets the stored response when the original finishes within the wait (or runs the
	 * handler itself when the original releases the key or its lease ends), else the 409.
	 * It holds a pool connection while it waits. Default 0: the 409 at once.
	 */
	wait?: Seconds;
	/**
	 * Past it the client gets 504, the heartbeat stops and the attempt's signal aborts; a late
	 * result is still stored if the key was not taken over (the transactional mode rolls it back).
	 * 0 or null: no limit. Default 300.
	 */
	handlerTimeout?: Seconds | null;
	/** Prefix of the problem `type`. Default 'urn:idempotency:problem:'. */
	problemTypeBase?: string;
	/** In-process LRU of finished results. Off by default. */
	cache?: { max: number };
	/** Where lost keys and database errors are reported. Default console.error. */
	log?: (message: string, err?: unknown) => void;
	/** Called after every successful heartbeat (monitoring). */
	onHeartbeat?: () => void;
}

/** What req.idempotency holds while a claimed request's handler runs. */
export interface IdempotencyContext extends RecoveryPoint {
	key: string;
	scope: string;
	/** Fencing token (decimal string): pass it downstream with the key. */
	token: string;
	/** 1 for the first attempt; more: an earlier attempt may have run partly. */
	attempt: number;
	/** Aborts when the key is lost to a takeover. */
	signal: AbortSignal;
	/** Transactional mode: the client of the open transaction; write on it. */
	client?: PoolClientLike;
}

/** The attempt context of a covered, claimed request (Express or Fastify). */
export function idempotencyContext(req: { idempotency?: IdempotencyContext | null }): IdempotencyContext | undefined;

export interface ExpressIdempotencyMiddleware {
	(req: IncomingMessage, res: ServerResponse, next: (err?: unknown) => void): Promise<void>;
	/** The same middleware in transactional mode: BEGIN, claim, handler's writes on req.idempotency.client, finish, COMMIT. */
	transactional: (req: IncomingMessage, res: ServerResponse, next: (err?: unknown) => void) => Promise<void>;
	/** The cache of finished results, when enabled. */
	cache: { readonly size: number } | null;
	/**
	 * Error middleware to mount after the routes (app.use(idem.errors)): marks a thrown error so
	 * that it releases the key even with storeServerErrors, then hands the error on.
	 */
	errors: (err: unknown, req: IncomingMessage, res: ServerResponse, next: (err?: unknown) => void) => void;
}

/** Express (or connect-style) middleware honouring the Idempotency-Key header. */
export function expressIdempotency<Req extends IncomingMessage = IncomingMessage>(
	options: HttpOptions<Req>,
): ExpressIdempotencyMiddleware;

/** Per-route Fastify setting: `config: { idempotency: false }` or `{ idempotency: { transactional: true, remember: 2592000, keepRequest: true } }`. */
export type FastifyRouteIdempotency = false | { transactional?: boolean; remember?: Seconds | null; keepRequest?: boolean };

/** Fastify plugin; `app.register(fastifyIdempotency, options)`. Needs no fastify-plugin. */
export function fastifyIdempotency(instance: any, options: HttpOptions<any>): Promise<void>;

/** Body-parser verify hook keeping the raw bytes: express.json({ verify: rawBody }). */
export function rawBody(req: IncomingMessage, res: ServerResponse, buf: Buffer): void;

export type ParsedIdempotencyKey =
	| { key: string }
	| { missing: true }
	| { problem: 'idempotency-key-malformed' | 'idempotency-key-repeated' | 'idempotency-key-too-long'; detail: string };

/** Parse Idempotency-Key field lines (RFC 8941 sf-string, bare sf-token tolerated). */
export function parseIdempotencyKey(values: string | string[] | undefined): ParsedIdempotencyKey;

/** 2xx/3xx succeeded except 304 released; 4xx failed except 408, 409, 425, 429 released; 5xx released (failed with storeServerErrors). */
export function defaultStorePolicy(status: number, options?: { storeServerErrors?: boolean }): StoreDecision;

export const MAX_KEY_LENGTH: 255;

/** Every problem the HTTP layer answers with: its status and title, by slug. */
export const PROBLEMS: Readonly<Record<string, Readonly<{ status: number; title: string }>>>;

// ---------------------------------------------------------------- completers

/** What a completer of HTTP keys (kind 'http') returns for a key: the response a retry replays. */
export interface CompletedResponse {
	/** The HTTP status; the middlewares' policy decides: 2xx, 3xx stored, 4xx stored as failed, 5xx releases the key. */
	status: number;
	/** Response headers stored with it (framing headers are dropped). */
	headers?: Record<string, string | number | string[]>;
	/** A Buffer (bytes), a string (text), or any other JSON value (application/json). */
	body?: unknown;
}

/** What the completer's hooks are told about a taken-over key. */
export interface CompleterEvent extends HookEvent<JsonValue | null> {
	token: string;
	attempt: number;
}

export interface CompleterOptions<T = unknown> {
	/** The pool the work goes through: the claims, heartbeats and finishes (PgBouncer in transaction mode is fine). */
	pool: Queryable;
	/**
	 * Finishes one taken-over key: gets the attempt as a job's fn does (phase, phaseData and
	 * checkpoint from the last recovery point, request the stored one); currentJob() is that
	 * attempt too. Its value is stored as the job's (kind 'job'), or is the response to store
	 * (kind 'http'). An error releases the key (retryable) or is stored as failed.
	 */
	handler: (attempt: AttemptInfo) => T | Promise<T>;
	/** The scope whose abandoned keys this completer takes over. Default ''. */
	scope?: string;
	/** Handlers running at once, and so the most keys one idem_claim_abandoned takes. Default 1. */
	concurrency?: number;
	/** The lease of each takeover; a heartbeat extends it every lease/3 while the handler runs. Default 30. */
	lease?: Seconds;
	/** Seconds between polls, the fallback when a notification is missed or LISTEN is down. Default 60. */
	pollInterval?: Seconds;
	/** How long the result is kept. Default: what the original claim set. */
	retention?: Seconds | null;
	/** How long the finished key is remembered past its retention. Default: what the original claim set. */
	remember?: Seconds | null;
	/** true: release the key on that error; false: store it as the key's failure. Default: every error releases. */
	retryable?: (err: unknown) => boolean;
	/** 'job' (default): the handler's value is the job's stored value; 'http': the handler returns a CompletedResponse. */
	kind?: 'job' | 'http';
	/**
	 * The LISTEN connection, which must reach the server directly (a transaction pooler such as
	 * PgBouncer in transaction mode does not deliver notifications): a connection string, a pg
	 * client config, a function returning a new (not connected) pg.Client or a promise of one,
	 * or false to only poll. Default: a client with the pool's own settings.
	 */
	listenClient?: string | Record<string, unknown> | (() => unknown) | false;
	/** Where failures are reported. Default console.error. */
	log?: (message: string, err?: unknown) => void;
	/** A key was taken over: its handler runs now, from phase. */
	onClaim?: (event: CompleterEvent & { phase: string | null }) => void | Promise<void>;
	/** A key was settled: stored as succeeded or failed, or released (error: the handler's). */
	onFinish?: (event: CompleterEvent & { status: 'succeeded' | 'failed' | 'released'; error?: unknown }) => void | Promise<void>;
	/** The store failed for a key, or the key was lost to another attempt. */
	onError?: (event: CompleterEvent & { error: unknown }) => void | Promise<void>;
}

export interface Completer {
	/** Check the extension (1.8 or later: MisconfiguredError otherwise), LISTEN, and take over what is abandoned now. */
	start(): Promise<void>;
	/** Take over what is abandoned now; resolves with the number of keys taken over. */
	poll(): Promise<number>;
	/** Take over nothing more, close the LISTEN connection, and resolve once every running handler has settled its key. */
	stop(): Promise<void>;
	/** Handlers running now. */
	readonly running: number;
	/** Whether the LISTEN connection is up (false: the completer only polls until it is back). */
	readonly listening: boolean;
}

/**
 * A completer of one scope (extension 1.8): takes over keys whose attempt was abandoned (its
 * lease ended, or its session-bound owner's session did) with idem_claim_abandoned, woken by
 * the sweep's NOTIFY idempotency_abandoned and a slow poll, and finishes each with the handler.
 */
export function completer<T = unknown>(options: CompleterOptions<T>): Completer;

// ---------------------------------------------------------------- errors

export class IdempotencyError extends Error {}

export class InProgressError extends IdempotencyError {
	readonly key: string;
	/** Seconds until the other attempt's lease ends (at least 1). */
	readonly retryAfter: number;
}

export class MismatchError extends IdempotencyError {
	readonly key: string;
}

/** The key was used and its result has expired; the server remembers it, so the work is not run again. */
export class ExpiredError extends IdempotencyError {
	readonly key: string;
	readonly scope: string;
	/** The key's outcome when it was settled. */
	readonly status: 'succeeded' | 'failed';
	/** The stored HTTP status; null for a job's key. */
	readonly responseCode: number | null;
}

export class StoredFailureError extends IdempotencyError {
	readonly key: string;
	readonly stored: { name: string; message: string };
}

export class KeyLostError extends IdempotencyError {
	readonly key: string;
}

/** The store cannot work as configured (no extension, an old one, ...): the message says what to fix. */
export class MisconfiguredError extends IdempotencyError {}

declare module 'http' {
	interface IncomingMessage {
		/** Set by pg-idempotency on a covered, claimed request. */
		idempotency?: IdempotencyContext;
		/** The raw body bytes, kept by rawBody() or read by the middleware. */
		rawBody?: Buffer;
	}
}
