'use strict';
/*
 * The Idempotency-Key request header: its field lines parsed into a key or a
 * problem slug with a detail for the client, the same limits for a key the
 * application computes itself (the key(req) option), and the field lines as
 * Node's request headers hold them.  It needs neither the database nor a
 * framework.
 */

const MAX_KEY_LENGTH = 255;

/*
 * A bare key: the characters of an RFC 8941 sf-token (tchar / ":" / "/").
 * A strict sf-token also starts with a letter or "*"; a bare UUID that starts
 * with a digit is accepted too, because many clients send their keys so and
 * the value is unambiguous.
 */
const TOKEN_RE = /^[!#$%&'*+\-.^_`|~0-9A-Za-z:/]+/;

/*
 * Parse the Idempotency-Key field: an RFC 8941 sf-string, or a bare sf-token.
 * `values` is one string per field line (Node's req.headersDistinct).
 * Returns { key } | { missing: true } | { problem: slug, detail }.
 */
function parseIdempotencyKey(values) {
	if (values === undefined || values === null)
		return { missing: true };
	const lines = Array.isArray(values) ? values : [values];
	if (lines.length === 0)
		return { missing: true };
	if (lines.length > 1)
		return repeated();
	const input = lines[0].replace(/^ +| +$/g, '');
	let key;
	let rest;
	if (input.startsWith('"')) {
		let out = '';
		let i = 1;
		for (; i < input.length; i++) {
			const c = input[i];
			const code = input.charCodeAt(i);
			if (c === '\\') {
				const next = input[i + 1];
				if (next !== '"' && next !== '\\')
					return malformed('A backslash in the quoted Idempotency-Key may only escape " or \\.');
				out += next;
				i++;
			} else if (c === '"') {
				break;
			} else if (code < 0x20 || code > 0x7e) {
				return malformed('The Idempotency-Key may only contain printable ASCII characters.');
			} else {
				out += c;
			}
		}
		if (i >= input.length)
			return malformed('The quoted Idempotency-Key has no closing quote.');
		key = out;
		rest = input.slice(i + 1);
	} else {
		const m = TOKEN_RE.exec(input);
		if (m === null) {
			if (input.length === 0)
				return malformed('The Idempotency-Key header is empty.');
			return malformed('The Idempotency-Key must be a quoted string, e.g. ' +
				'Idempotency-Key: "8e03978e-40d5-43e8-bc93-6894a57f9324" (a bare value may ' +
				'hold only token characters).');
		}
		key = m[0];
		rest = input.slice(key.length);
	}
	const after = rest.replace(/^[ \t]+/, '');
	if (after.startsWith(','))
		return repeated();
	if (after.length > 0)
		return malformed(after.startsWith(';')
			? 'The Idempotency-Key takes no parameters.'
			: 'The Idempotency-Key holds characters that are not allowed.');
	if (key.length === 0)
		return malformed('The Idempotency-Key is empty.');
	if (key.length > MAX_KEY_LENGTH)
		return {
			problem: 'idempotency-key-too-long',
			detail: `The Idempotency-Key is ${key.length} characters long; ` +
				`the limit is ${MAX_KEY_LENGTH} characters.`,
		};
	return { key };
}

function malformed(detail) {
	return { problem: 'idempotency-key-malformed', detail };
}

function repeated() {
	return {
		problem: 'idempotency-key-repeated',
		detail: 'Send exactly one Idempotency-Key header holding one key.',
	};
}

/*
 * A key returned by the key(req) option: the same limits as the header's
 * key, without its quoting rules (the value comes from the application).
 */
function checkCustomKey(value) {
	if (typeof value !== 'string')
		throw new TypeError(`key(req) must return a string, or null when the request has none; got ${typeof value}`);
	if (value.length === 0)
		return malformed('The idempotency key of this request is empty.');
	if (/[\u0000-\u001f\u007f]/.test(value))
		return malformed('The idempotency key of this request holds control characters.');
	if (value.length > MAX_KEY_LENGTH)
		return {
			problem: 'idempotency-key-too-long',
			detail: `The idempotency key is ${value.length} characters long; ` +
				`the limit is ${MAX_KEY_LENGTH} characters.`,
		};
	return { key: value };
}

/* the Idempotency-Key field lines of a Node request (headersDistinct), else its one value */
function keyLinesOf(headers, headersDistinct) {
	if (headersDistinct)
		return headersDistinct['idempotency-key'];
	const v = headers['idempotency-key'];
	return v === undefined ? undefined : [v];
}

module.exports = { MAX_KEY_LENGTH, parseIdempotencyKey, checkCustomKey, keyLinesOf };
