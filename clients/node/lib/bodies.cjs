'use strict';
/*
 * Request and response bodies as bytes: the request size limit (maxBodySize)
 * and what a body reader returns over it, the stored form of a response body
 * (JSON text that jsonb keeps as it is, else base64), the statuses that carry
 * no body, and the framing headers, which belong to one connection and not to
 * the response.  The HTTP engine and both framework adapters share these.
 */

/* how a response is framed on one connection: never stored, never replayed */
const FRAMING_HEADERS = new Set(['transfer-encoding', 'content-length', 'connection', 'keep-alive',
	'upgrade', 'te', 'trailer', 'proxy-connection']);
const DEFAULT_MAX_BODY_SIZE = 1024 * 1024;  /* bytes */

function isJsonType(contentType) {
	if (typeof contentType !== 'string')
		return false;
	const media = contentType.split(';')[0].trim().toLowerCase();
	return media === 'application/json' || /^[a-z0-9!#$&^_.+-]+\/[a-z0-9!#$&^_.+-]+\+json$/.test(media);
}

const utf8 = new TextDecoder('utf-8', { fatal: true, ignoreBOM: true });

/* jsonb refuses \u0000 and unpaired surrogate escapes */
const JSONB_REFUSES = /\\u(0000|d[89a-f][0-9a-f]{2})/i;

/* the body as JSON text jsonb accepts as it is, or null */
function jsonText(body) {
	try {
		const text = utf8.decode(body);
		JSON.parse(text);
		return JSONB_REFUSES.test(text) ? null : text;
	} catch {
		return null;
	}
}

/*
 * The envelope's body member: "json" when the body is JSON that jsonb keeps
 * as it is, "base64" otherwise.
 */
function bodyMember(contentType, body) {
	if (body.length === 0)
		return null;
	if (isJsonType(contentType)) {
		const text = jsonText(body);
		if (text !== null)
			return { json: text };
	}
	return { base64: body.toString('base64') };
}

/*
 * maxBodySize: bytes; null or 0 lifts the limit (Infinity here), absent is
 * the default.  A bad value fails at construction, not at the first request.
 */
function bodyLimit(value) {
	if (value === undefined)
		return DEFAULT_MAX_BODY_SIZE;
	if (value === null || value === 0)
		return Infinity;
	if (!Number.isSafeInteger(value) || value < 0)
		throw new TypeError(`maxBodySize must be a whole number of bytes (0 or null: no limit), got ${String(value)}`);
	return value;
}

/* the request body was over maxBodySize: what a rawBody() reader returns then */
const TOO_LARGE = Symbol('pg-idempotency.tooLarge');

function toBuffer(chunk, encoding) {
	if (chunk === undefined || chunk === null)
		return null;
	if (Buffer.isBuffer(chunk))
		return chunk;
	if (chunk instanceof Uint8Array)
		return Buffer.from(chunk.buffer, chunk.byteOffset, chunk.byteLength);
	return Buffer.from(String(chunk), typeof encoding === 'string' ? encoding : 'utf8');
}

/* 204 and 304 carry no body, and so no content-length */
function hasBody(status) {
	return status !== 204 && status !== 304;
}

module.exports = {
	FRAMING_HEADERS,
	isJsonType,
	jsonText,
	bodyMember,
	bodyLimit,
	TOO_LARGE,
	toBuffer,
	hasBody,
};
